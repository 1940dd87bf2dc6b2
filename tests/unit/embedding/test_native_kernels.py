"""The native CPU kernels (``kernel="native"``, ``neorec/native/tbe.c``): the choice
of path, the build, large batches against the torch path, determinism over thread counts, and the
huge-page buffers. (Small cases against the plain reference: test_tbe_reference.py.)

    python -m pytest tests/unit/embedding/test_native_kernels.py -q
"""

from __future__ import annotations

import pytest
import torch

import neorec.embedding.kernels.native_tbe as native_tbe
import neorec.native.build as native_build
from neorec.embedding import SparseOptimizerConfig, StorageConfig, TableBatchedEmbeddingBags, TableConfig
from neorec.embedding.memory import MIN_BYTES, advise_huge_pages, empty_huge
from neorec.sparse import KeyedJaggedTensor

from test_tbe_reference import make_batch, make_tables


def big_tables():
    """Enough rows for three radix passes (2^19 > 2^18 rows), two dims, a table with two features."""
    return [
        TableConfig("wide", 600_000, 16, ["w1", "w2"]),
        TableConfig("small", 300, 64, ["s"], pooling="mean"),
        TableConfig("mid", 40_000, 16, ["m"]),
    ]


def big_batch(generator: torch.Generator, batch_size: int = 512, weighted: bool = True) -> KeyedJaggedTensor:
    rows = {"w1": 600_000, "w2": 600_000, "s": 300, "m": 40_000}
    lengths = torch.randint(0, 12, (len(rows), batch_size), generator=generator)
    values = []
    for k, (key, count) in enumerate(rows.items()):
        hot = torch.randint(0, 50, (int(lengths[k].sum()),), generator=generator)  # repeated rows
        cold = torch.randint(0, count, hot.shape, generator=generator)
        values.append(torch.where(torch.rand(hot.shape, generator=generator) < 0.5, hot, cold))
    values = torch.cat(values)
    weights = torch.rand(values.numel(), generator=generator) if weighted else None
    return KeyedJaggedTensor(list(rows), values, lengths.flatten(), weights)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "rowwise_adagrad"])
def test_native_matches_torch_path_on_large_batches(kind, monkeypatch):
    monkeypatch.setattr(native_tbe, "_threads", lambda work: 2)
    config = SparseOptimizerConfig(kind, learning_rate=0.05, weight_decay=0.001)
    torch_path = TableBatchedEmbeddingBags(big_tables(), config, init_seed=2, kernel="torch")
    native = TableBatchedEmbeddingBags(big_tables(), config, init_seed=2, kernel="native")
    torch_path.track_modified_rows()
    native.track_modified_rows()
    generator = torch.Generator().manual_seed(0)
    for step in range(3):
        kjt = big_batch(generator, weighted=step != 1)
        grad = torch.randn(512, sum(native.feature_dims), generator=generator)
        expected, got = torch_path(kjt).values, native(kjt).values
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        expected.backward(grad)
        got.backward(grad)
        torch.testing.assert_close(native.weights, torch_path.weights, rtol=1e-5, atol=1e-6)
        if kind != "sgd":
            torch.testing.assert_close(native.momentum1, torch_path.momentum1, rtol=1e-5, atol=1e-7)
    assert torch.equal(native.modified_rows, torch_path.modified_rows) and native.modified_rows.any()


def test_native_gives_the_same_bits_on_any_number_of_threads(monkeypatch):
    results = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(native_tbe, "_threads", lambda work, threads=threads: threads)
        module = TableBatchedEmbeddingBags(big_tables(), SparseOptimizerConfig("rowwise_adagrad"), init_seed=1,
                                           kernel="native")
        generator = torch.Generator().manual_seed(3)
        outputs = []
        for _ in range(2):
            out = module(big_batch(generator)).values
            outputs.append(out.detach().clone())
            out.backward(torch.randn(out.shape, generator=generator))
        results.append((module.weights.clone(), module.momentum1.clone(), outputs))
    for weights, state, outputs in results[1:]:
        assert torch.equal(weights, results[0][0]) and torch.equal(state, results[0][1])
        assert all(torch.equal(a, b) for a, b in zip(outputs, results[0][2]))


def test_auto_takes_native_where_it_serves_and_torch_elsewhere():
    tables = make_tables("mixed")
    for kind in ("sgd", "adagrad", "rowwise_adagrad"):
        assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(kind)).kernel_path() == "native"
    assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("adam")).kernel_path() == "torch"
    assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), StorageConfig("bf16")).kernel_path() == "torch"
    assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), dense_gradient=True).kernel_path() == "torch"
    assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), kernel="torch").kernel_path() == "torch"
    with pytest.raises(ValueError, match="kernel='native' was asked for but optimizer 'adam' has no native kernel"):
        TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("adam"), kernel="native").kernel_path()
    with pytest.raises(ValueError, match="kernel='native' was asked for but the native kernels take fp32"):
        TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), StorageConfig("fp16"), kernel="native").kernel_path()
    with pytest.raises(ValueError, match="kernel must be one of"):
        TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), kernel="c")
    wide = [TableConfig("wide", 2, (1 << 16) + 1)]  # its scratch row would not fit a thread's stack
    assert TableBatchedEmbeddingBags(wide, SparseOptimizerConfig()).kernel_path() == "torch"
    with pytest.raises(ValueError, match="a table of dim 65537: the native kernels take dims up to 65536"):
        TableBatchedEmbeddingBags(wide, SparseOptimizerConfig(), kernel="native").kernel_path()
    assert TableBatchedEmbeddingBags([TableConfig("w", 2, 1 << 16)], SparseOptimizerConfig()).kernel_path() == "native"


def test_without_a_compiler_auto_falls_back_and_native_says_why(monkeypatch):
    monkeypatch.setattr(native_build, "_library", None)
    monkeypatch.setattr(native_build, "_failure", None)
    monkeypatch.setattr(native_build, "find_compiler", lambda: None)
    assert "no C compiler found" in native_build.native_available()
    tables = make_tables("sum")
    fallback = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad"), init_seed=3)
    assert fallback.kernel_path() == "torch"
    kjt = make_batch(tables, 4, torch.Generator().manual_seed(0), weighted=False)
    fallback(kjt).values.sum().backward()  # trains on torch ops
    assert fallback.step_count == 1
    with pytest.raises(ValueError, match="kernel='native' was asked for but no C compiler found"):
        TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), kernel="native").kernel_path()


def test_build_goes_to_the_cache_folder_and_is_reused(monkeypatch, tmp_path):
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(tmp_path))
    compiler = native_build.find_compiler()
    first = native_build._build(compiler)
    assert first.parent == tmp_path and first.suffix == ".so" and first.stat().st_size > 0
    stamp = first.stat().st_mtime_ns
    assert native_build._build(compiler) == first and first.stat().st_mtime_ns == stamp  # not rebuilt
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary left behind


def test_the_temp_fallback_folder_is_used_only_while_it_is_this_users_alone(monkeypatch, tmp_path):
    """When the cache folder cannot be made, the build went to /tmp/neorec-kernels-<uid> whatever
    that was, and loaded any library of the expected name found there: another user could plant one.
    Now a folder others may write to (or a link) is passed over for a fresh private one."""
    import os
    import stat
    import tempfile

    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(blocker / "kernels"))  # cannot be created
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    shared = tmp_path / f"neorec-kernels-{os.getuid()}"
    assert native_build._writable_cache() == shared and stat.S_IMODE(shared.stat().st_mode) == 0o700
    shared.chmod(0o777)  # as if made by someone else for everyone
    fresh = native_build._writable_cache()
    assert fresh != shared and fresh.parent == tmp_path and stat.S_IMODE(fresh.stat().st_mode) == 0o700
    shared.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    shared.symlink_to(elsewhere)
    assert native_build._writable_cache() not in (shared, elsewhere)
    shared.unlink()
    shared.mkdir(mode=0o700)
    assert native_build._writable_cache() == shared


def test_a_compiler_failing_without_a_message_is_reported_with_its_exit_code_and_command(monkeypatch, tmp_path):
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(tmp_path))
    real_run = native_build.subprocess.run

    def silent_failure(command, **kwargs):
        if "-o" in command:
            return real_run(["sh", "-c", "exit 3"], **kwargs)
        return real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", silent_failure)
    with pytest.raises(native_build.NativeUnavailable,
                       match=r"failed, exit code 3, without a message; the command was: .* -O3 .*tbe\.c .*-o "):
        native_build._build(native_build.find_compiler())


def test_native_rejects_bad_ids_before_any_update():
    tables = make_tables("sum")
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"), kernel="native")
    before = module.weights.clone()
    kjt = KeyedJaggedTensor(["f_a1", "f_a2", "f_b", "f_c", "f_d"], torch.tensor([1, 2, 3, 29, 4]),
                            torch.tensor([1, 1, 1, 1, 1]))
    with pytest.raises(ValueError, match=r"feature 'f_c' \(table 't16'\): id 29 is outside the table's rows \[0, 29\)"):
        module(kjt).values.sum().backward()
    assert torch.equal(module.weights, before) and module.step_count == 0


def test_native_forward_without_grad_and_empty_batches():
    tables = make_tables("mixed")
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), kernel="native")
    kjt = make_batch(tables, 5, torch.Generator().manual_seed(2), weighted=True)
    with torch.no_grad():
        out = module(kjt).values
    assert not out.requires_grad and module.step_count == 0
    reference = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig(), kernel="torch")
    torch.testing.assert_close(out, reference(kjt).values)
    keys = ["f_a1", "f_a2", "f_b", "f_c", "f_d"]
    empty = KeyedJaggedTensor(keys, torch.zeros(0, dtype=torch.int64), torch.zeros(15, dtype=torch.int64))
    pooled = module(empty).values
    assert pooled.shape == (3, 44) and not pooled.any()
    pooled.sum().backward()  # no ids: a step that touches nothing
    assert module.step_count == 1
    assert module(KeyedJaggedTensor(keys, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64),
                                    batch_size=0)).values.shape == (0, 44)


def test_empty_huge_gives_a_plain_tensor_on_advised_pages():
    big = empty_huge(MIN_BYTES // 4 + 12345, torch.float32)
    assert big.shape == (MIN_BYTES // 4 + 12345,) and big.dtype == torch.float32 and big.is_contiguous()
    big.fill_(2.0)
    assert float(big.sum()) == 2.0 * big.numel()
    assert not advise_huge_pages(torch.empty(10))  # small buffers are left alone
    import sys
    from pathlib import Path

    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if sys.platform.startswith("linux") and thp.exists() and "[never]" not in thp.read_text():
        assert advise_huge_pages(torch.empty(MIN_BYTES // 4))


@pytest.mark.filterwarnings("ignore::neorec.embedding.path_common.SecondLookupWarning")  # (two lookups, on purpose)
def test_native_backward_refuses_ids_changed_after_the_forward():
    """Ids changed in place between forward and backward are an error, never an update of other
    rows than were looked up: autograd's version check, and behind it (a change through ``.data``
    bumps no version) the backward's own check of the ids against the tables."""
    tables = make_tables("sum")
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"), kernel="native")
    keys, lengths = ["f_a1", "f_a2", "f_b", "f_c", "f_d"], torch.tensor([1, 1, 1, 1, 1])
    before = {t.name: module.get_table_weight(t.name) for t in tables}
    values = torch.tensor([1, 2, 3, 4, 4])
    out = module(KeyedJaggedTensor(keys, values, lengths)).values
    values[4] = 7  # still a row of the table: only the version check can tell
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()
    for name, weight in before.items():  # refused before any update
        assert torch.equal(module.get_table_weight(name), weight), name
    values = torch.tensor([1, 2, 3, 4, 4])
    out = module(KeyedJaggedTensor(keys, values, lengths)).values
    values.data[4] = 10**9  # behind autograd's back, outside the table
    with pytest.raises(ValueError, match="changed between forward and backward"):
        out.sum().backward()
    assert torch.equal(module.get_table_weight("t8b"), before["t8b"])  # no write outside (or into) that table


def test_a_compiler_without_openmp_gets_a_single_threaded_build(monkeypatch, tmp_path):
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(tmp_path))
    real_run = native_build.subprocess.run
    commands = []

    def no_openmp(command, **kwargs):
        commands.append(command)
        if "-fopenmp" in command:
            return real_run(["sh", "-c", "echo 'unsupported option -fopenmp' >&2; exit 1"], **kwargs)
        return real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", no_openmp)
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = native_build._build(native_build.find_compiler())
    assert built.exists() and built.parent == tmp_path
    compiles = [c for c in commands if "-o" in c]
    assert len(compiles) == 2 and "-fopenmp" in compiles[0] and "-fopenmp" not in compiles[1]
    assert any("without OpenMP: they run on one thread" in str(w.message) and "unsupported option -fopenmp"
               in str(w.message) for w in caught)
    import ctypes

    assert hasattr(ctypes.CDLL(str(built)), "neorec_backward_update")
    # a later process loads it without compiling with -fopenmp again (every rank paid ~9 s for nothing), and is told
    commands.clear()
    with pytest.warns(UserWarning, match="built without OpenMP: they run on one thread .*remove that file"):
        assert native_build._build(native_build.find_compiler()) == built
    assert not [c for c in commands if "-o" in c]


def _fake_compiles(monkeypatch, tmp_path):
    """Compiles that only write their output file (fast); the compiles made are listed."""
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(tmp_path))
    real_run = native_build.subprocess.run
    compiles = []

    def fake(command, **kwargs):
        if "-o" in command:
            compiles.append(command)
            open(command[command.index("-o") + 1], "wb").close()
            return real_run(["true"], **kwargs)
        return real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", fake)
    return compiles


def test_the_cache_key_holds_the_compiler_commands_own_words(monkeypatch, tmp_path):
    """`gcc -fsanitize=address` prints gcc's version: it shared gcc's cached library (loading an
    ASan build then killed every later plain run)."""
    compiles = _fake_compiles(monkeypatch, tmp_path)
    compiler = native_build.find_compiler()
    plain = native_build._build(compiler)
    sanitized = native_build._build(f"{compiler} -fsanitize=address")
    assert plain != sanitized and len(compiles) == 2
    assert native_build._build(compiler) == plain and len(compiles) == 2  # reused


def test_a_relative_or_home_cache_folder_is_made_absolute(monkeypatch, tmp_path):
    """NEOREC_KERNEL_CACHE=. built ./neorec_cpu-*.so, which dlopen then looked for in the system's
    folders ("cannot open shared object file"); ~/x made a folder named "~"."""
    import os

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", ".")
    assert native_build.cache_dir() == tmp_path
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", "~/kernels")
    assert native_build.cache_dir() == tmp_path / "home" / "kernels"
    assert os.path.isabs(native_build.cache_dir())


def test_a_library_that_cannot_be_mapped_names_its_folder(monkeypatch, tmp_path):
    import ctypes

    def noexec(path):
        raise OSError(f"{path}: failed to map segment from shared object")

    monkeypatch.setattr(ctypes, "CDLL", noexec)
    with pytest.raises(OSError, match=f"is {tmp_path} on a noexec mount\\? set NEOREC_KERNEL_CACHE"):
        native_build._load_library(tmp_path / "neorec_cpu-x.so")


def test_environment_switch_turns_the_native_kernels_off(monkeypatch):
    monkeypatch.setenv("NEOREC_NATIVE", "0")
    assert "switched off (NEOREC_NATIVE=0)" in native_build.native_available()
    tables = make_tables("sum")
    assert TableBatchedEmbeddingBags(tables, SparseOptimizerConfig()).kernel_path() == "torch"
    monkeypatch.setenv("NEOREC_NATIVE", "1")
    assert native_build.native_available() is None


def test_native_refuses_buffers_changed_under_it():
    tables = make_tables("sum")
    module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad"), kernel="native")
    kjt = make_batch(tables, 3, torch.Generator().manual_seed(0), weighted=False)
    module(kjt)
    module.weights = module.weights.double()  # the buffer becomes float64 while the module stays on the native path
    with pytest.raises(ValueError, match="weights must stay a contiguous torch.float32 tensor"):
        module(kjt)


def test_without_a_home_folder_the_build_goes_to_a_private_temp_folder(monkeypatch, tmp_path):
    """No HOME and no passwd entry (a container run as an unnamed user): Path.home() raised, and
    every TBE and DotInteraction with kernel "auto" raised with it instead of building elsewhere."""
    import os
    import pathlib
    import tempfile

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("NEOREC_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(pathlib.Path, "home", staticmethod(no_home))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    assert native_build.cache_dir() is None
    assert native_build._writable_cache() == tmp_path / f"neorec-kernels-{os.getuid()}"


def test_the_cache_key_tells_cpus_apart_on_every_architecture():
    """Only x86's "model name" / "flags" lines were kept: on ARM every CPU had the same (empty) key,
    so a cache shared by two kinds of node handed one the other's -march=native library (SIGILL)."""
    graviton2 = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32\n" \
                "CPU implementer\t: 0x41\nCPU part\t: 0xd0c\n"
    graviton3 = "processor\t: 0\nBogoMIPS\t: 2100.00\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 sve\n" \
                "CPU implementer\t: 0x41\nCPU part\t: 0xd40\n"
    assert native_build._cpu_signature(graviton2) != native_build._cpu_signature(graviton3)
    x86 = "processor\t: 0\nmodel name\t: AMD EPYC\ncpu MHz\t\t: 2994.374\nflags\t\t: fpu avx2\n"
    same = x86.replace("2994.374", "1500.000").replace("processor\t: 0", "processor\t: 1")
    assert native_build._cpu_signature(x86) == native_build._cpu_signature(same)  # clock and core number: not the kind


def test_a_compiler_command_with_words_of_its_own_is_used_whole(monkeypatch, tmp_path):
    """CC="ccache gcc" was not found as a program and the build quietly used cc instead."""
    import shutil

    monkeypatch.setenv("CC", "/nonexistent/cc")
    with pytest.warns(UserWarning, match=r"CC='/nonexistent/cc': '/nonexistent/cc' is not on the PATH; the native "
                                         r"kernels are built with /"):
        assert native_build.find_compiler() == shutil.which("cc")  # said, not silently replaced
    monkeypatch.setenv("CC", "env cc")
    assert native_build.find_compiler() == f"{shutil.which('env')} cc"
    monkeypatch.setenv("NEOREC_KERNEL_CACHE", str(tmp_path))
    commands = []
    real_run = native_build.subprocess.run

    def record(command, **kwargs):
        commands.append(command)
        return real_run(["sh", "-c", "exit 3"], **kwargs) if "-o" in command else real_run(command, **kwargs)

    monkeypatch.setattr(native_build.subprocess, "run", record)
    with pytest.raises(native_build.NativeUnavailable):
        native_build._build(native_build.find_compiler())
    assert commands[0] == [shutil.which("env"), "cc", "--version"]
    assert commands[1][:3] == [shutil.which("env"), "cc", "-O3"]


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("start, to", [("sgd", "rowwise_adagrad"), ("rowwise_adagrad", "adagrad")])
def test_changing_the_optimizer_kind_of_a_built_module_is_refused(kernel, start, to):
    """The native backward wrote through a missing state (SIGSEGV) or used a [rows] row-wise state
    as AdaGrad's [rows * dim] one (a heap overrun); the torch path raised a bare KeyError."""
    module = TableBatchedEmbeddingBags([TableConfig("t", 64, 8)], SparseOptimizerConfig(start), kernel=kernel)
    module.optimizer.kind = to
    before = module.weights.clone()
    with pytest.raises(ValueError, match=f"optimizer.kind is now '{to}', but the optimizer state was built for '{start}'"):
        module(KeyedJaggedTensor(["t"], torch.tensor([63, 3]), torch.tensor([2]))).values.sum().backward()
    assert torch.equal(module.weights, before) and int(module.step) == 0
    module.optimizer.kind = start
    module.optimizer.learning_rate = 0.5  # what may change between steps
    module(KeyedJaggedTensor(["t"], torch.tensor([63, 3]), torch.tensor([2]))).values.sum().backward()
    assert not torch.equal(module.weights, before)


@pytest.mark.parametrize("kernel", ["torch", "native"])
@pytest.mark.parametrize("setting, value, message", [
    ("learning_rate", 0.0, "learning_rate must be > 0, got 0.0"),
    ("learning_rate", float("nan"), "learning_rate must be finite, got nan"),
    ("weight_decay", -0.1, "weight_decay must be >= 0, got -0.1"),
])
def test_optimizer_settings_changed_out_of_range_are_refused_before_the_update(kernel, setting, value, message):
    """The settings may change between steps; one out of range was taken by the torch and native
    paths (and refused by the Triton kernel alone, after it had counted the step)."""
    module = TableBatchedEmbeddingBags([TableConfig("t", 64, 8)], SparseOptimizerConfig("rowwise_adagrad"), kernel=kernel)
    setattr(module.optimizer, setting, value)
    before, state = module.weights.clone(), module.momentum1.clone()
    with pytest.raises(ValueError, match=f"the optimizer's settings changed since it was built: sparse optimizer {message}$"):
        module(KeyedJaggedTensor(["t"], torch.tensor([63, 3]), torch.tensor([2]))).values.sum().backward()
    assert torch.equal(module.weights, before) and torch.equal(module.momentum1, state) and int(module.step) == 0


@pytest.mark.parametrize("weighted", [False, True])
def test_an_unvalidated_batch_whose_lengths_pass_its_values_is_refused_before_the_kernels(weighted):
    """validate=False and lengths summing past the values: the kernels read ids and weights past the
    tensors' ends and pooled whatever lay there."""
    module = TableBatchedEmbeddingBags([TableConfig("t", 10, 4)], SparseOptimizerConfig("sgd"), kernel="native")
    weights = torch.ones(2) if weighted else None
    kjt = KeyedJaggedTensor(["t"], torch.tensor([1, 2]), torch.tensor([2, 3]), weights=weights, batch_size=2,
                            validate=False)
    with pytest.raises(ValueError, match="its lengths add up to 5, but it has 2 values"):
        with torch.no_grad():
            module(kjt)
    with pytest.raises(ValueError, match="its lengths add up to 5, but it has 2 values"):
        module(kjt).values.sum().backward()
    negative = KeyedJaggedTensor(["t"], torch.tensor([1, 2]), torch.tensor([5, -3]), weights=weights, batch_size=2,
                                 validate=False)  # adds up, but bag 0 would read ids[0:5]
    with pytest.raises(ValueError, match="a negative length"):
        with torch.no_grad():
            module(negative)


def test_a_wider_interaction_than_the_native_kernels_take_runs_on_torch_ops():
    """The native backward keeps a [dim] row on the stack: a dim of 3,000,001 overflowed it (SIGSEGV)."""
    from neorec.model.dlrm import DotInteraction
    from neorec.model.native_interaction import native_interaction_supported
    from neorec.native import MAX_NATIVE_DIM

    dim = MAX_NATIVE_DIM + 1
    generator = torch.Generator().manual_seed(0)
    dense = torch.randn(1, dim, generator=generator, requires_grad=True)
    sparse = torch.randn(1, 1, dim, generator=generator, requires_grad=True)
    assert not native_interaction_supported(dense, sparse)
    assert native_interaction_supported(dense[:, :MAX_NATIVE_DIM], sparse[:, :, :MAX_NATIVE_DIM])
    out = DotInteraction(1, embedding_dim=dim, kernel="auto")(dense, sparse)
    out.sum().backward()
    # against the exact dot product: an fp32 sum of 65,537 products is ~1e-3 off (allclose's relative
    # 1e-5 against another fp32 sum failed 5 unseeded draws in 30); one product (~1) missing is not
    products = dense[0].detach().double() * sparse[0, 0].detach().double()
    assert abs(out[0, -1].item() - products.sum().item()) <= 1e-6 * products.abs().sum().item()  # ~0.05
    assert dense.grad is not None
    with pytest.raises(ValueError, match=f"fp32 CPU tensors of dims 1 to {MAX_NATIVE_DIM}"):
        DotInteraction(1, embedding_dim=dim, kernel="native")(dense, sparse)


def test_a_runs_header_says_which_kernel_serves_the_tables_and_why_auto_fell_back():
    """Nothing said whether the native (or on a GPU the Triton) kernels ran or why "auto" took torch ops."""
    from neorec.embedding.kernel_choice import kernel_summary

    tables = [TableConfig("t", 16, 8)]
    assert kernel_summary(TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("rowwise_adagrad"))) == "native"
    assert kernel_summary(TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("adam"))) == \
        "torch (optimizer 'adam' has no native kernel (have ('sgd', 'rowwise_adagrad', 'adagrad')))"
    assert kernel_summary(TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"), kernel="torch")) == "torch"


@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_an_unvalidated_batch_is_checked_whole_before_its_keys_are_selected(kernel):
    """Keys a superset or a permutation of the features: the check ran on the selected keys only,
    where the lengths add up again. A dropped key saying 0 ids while holding one shifted the kept
    key's ids (row 7 pooled for id 3); a negative length in it passed; a surplus id was dropped."""
    module = TableBatchedEmbeddingBags([TableConfig("t", 10, 4, feature_names=["a", "b"])], SparseOptimizerConfig("sgd"),
                                       kernel=kernel)
    cases = [(["extra", "a", "b"], [7, 3, 4], [0, 1, 1], "its lengths sum to 2 but it holds 3 values"),
             (["extra", "a", "b"], [3, 4, 5], [-1, 1, 1, 1, 1, 0], "a negative length"),
             (["b", "a"], [3, 4, 5], [1, 1], "its lengths sum to 2 but it holds 3 values")]
    for keys, values, lengths, message in cases:
        kjt = KeyedJaggedTensor(keys, torch.tensor(values), torch.tensor(lengths), validate=False)
        with pytest.raises(ValueError, match=f"KeyedJaggedTensor: {message}"):
            module(kjt)
    weighted = KeyedJaggedTensor(["a", "b"], torch.tensor([3, 4]), torch.tensor([1, 1]), torch.ones(3), validate=False)
    with pytest.raises(ValueError, match="KeyedJaggedTensor: 3 weights for 2 values"):  # the torch path ignored one
        module(weighted)


@pytest.mark.parametrize("path", ["torch", "cached", "sharded"])
def test_a_negative_length_is_refused_on_every_path_before_torch_ops_read_it(path, tmp_path):
    """validate=False, lengths that add up but one negative: torch's repeat_interleave (the torch ops
    path, the cache's slot mapping, the sharded input) wrote past its output before refusing the
    negative repeat, and glibc aborted the process ("free(): invalid next size")."""
    from neorec.embedding.cached import CachedEmbeddingBagCollection
    from neorec.embedding.locations import TableLocation

    tables = [TableConfig("t", 10, 4, feature_names=["a", "b"])]
    if path == "torch":
        module = TableBatchedEmbeddingBags(tables, SparseOptimizerConfig("sgd"), kernel="torch")
    elif path == "cached":
        module = CachedEmbeddingBagCollection(tables, SparseOptimizerConfig("sgd"), init_seed=0,
                                              locations={"t": TableLocation("cached_dram", cache_rows=8)})
    else:  # the sharded input checks it before anything else (no routing or group needed to see it)
        from neorec.sharding.input_dist import input_dist

        def module(features):
            return input_dist(None, 0, features, None)
    negative = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([3, -1, 1, 0]), batch_size=2,
                                 validate=False)  # they add up to the 3 values
    with pytest.raises(ValueError, match="KeyedJaggedTensor: a negative length"):
        module(negative)
    if path == "cached":
        module.close()
