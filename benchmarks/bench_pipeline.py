"""Pipelined training and quantized communication on 2 ranks: samples/s with and without the
pipeline and with each codec of the pooled-embedding exchange, the step timeline (input all-to-all
time, exposed communication fraction) and the bytes on the wire.

The 2 ranks run ``neorec train --profile`` (the default job's DLRM and data, ``--max-steps``) in
two network namespaces joined by a veth pair shaped with ``tc`` (rate ~1 Gbit/s each way; 0.5 ms
delay with netem where the kernel has it), so that communication costs something; the benchmark
creates the namespaces and the link itself and removes them in ``finally`` (traffic stays between
them: rank 0 listens on its veth address, gloo is bound to the veth with GLOO_SOCKET_IFNAME).
Needs root and ``ip``/``tc``; ``--network loopback`` (or a failure to create the namespaces, which
is reported) runs both ranks on the host's loopback instead, and the results say so.

Variants (run alternately, ``--repeats`` rounds, medians): ``plain`` (``--no-pipeline``, fp32),
``pipeline`` (fp32), ``pipeline+fp16`` / ``+bf16`` / ``+int8`` (both directions).
Bytes: what rank 0's collectives hand to the other rank (``CommStats``, per collective) and the
veth's transmitted bytes (``ip -s link``: everything, headers and DDP's all-reduce included).

Run (from the repository root, venv active, as root; about 10 minutes on a loaded 2-core machine):

    python benchmarks/bench_pipeline.py --out benchmarks/results/bench_pipeline.json
    python benchmarks/bench_pipeline.py --network loopback --repeats 1 --steps 10   # quick look
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from bench_args import at_least, check_out, number  # same folder (run as a script)

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "plain": ["--no-pipeline"],
    "pipeline": [],
    "pipeline+fp16": ["--set", 'embedding.comm.forward="fp16"', "--set", 'embedding.comm.backward="fp16"'],
    "pipeline+bf16": ["--set", 'embedding.comm.forward="bf16"', "--set", 'embedding.comm.backward="bf16"'],
    "pipeline+int8": ["--set", 'embedding.comm.forward="int8"', "--set", 'embedding.comm.backward="int8"'],
}


def _run(command: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(command), capture_output=True, text=True, check=check, timeout=60)


class VethPair:
    """Two network namespaces joined by a shaped veth pair; ``close()`` removes them."""

    def __init__(self, rate: str, delay_ms: float) -> None:
        tag = secrets.token_hex(3)
        self.namespaces = (f"nrbench{tag}a", f"nrbench{tag}b")
        self.links = (f"nrb{tag}a", f"nrb{tag}b")
        subnet = 16 + int(tag[:2], 16) % 200
        self.addresses = (f"10.{subnet}.77.1", f"10.{subnet}.77.2")
        self.shaping: List[str] = []
        self.notes: List[str] = []
        self._created: List[str] = []
        try:
            for ns in self.namespaces:
                _run(["ip", "netns", "add", ns])
                self._created.append(ns)
            _run(["ip", "link", "add", self.links[0], "type", "veth", "peer", "name", self.links[1]])
            for ns, link, address in zip(self.namespaces, self.links, self.addresses):
                _run(["ip", "link", "set", link, "netns", ns])
                _run(["ip", "-n", ns, "addr", "add", f"{address}/24", "dev", link])
                _run(["ip", "-n", ns, "link", "set", link, "up"])
                _run(["ip", "-n", ns, "link", "set", "lo", "up"])
                self._shape(ns, link, rate, delay_ms)
        except BaseException:
            self.close()
            raise

    def _shape(self, ns: str, link: str, rate: str, delay_ms: float) -> None:
        netem = _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "netem",
                      "delay", f"{delay_ms}ms", "rate", rate], check=False)
        if netem.returncode == 0:
            self.shaping.append(f"{link}: netem delay {delay_ms}ms rate {rate}")
            return
        self.notes.append(f"netem on {link} failed ({netem.stderr.strip()}): rate-limited with tbf, no added delay")
        _run(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", link, "root", "tbf", "rate", rate,
              "burst", "256kb", "latency", "50ms"])
        self.shaping.append(f"{link}: tbf rate {rate} burst 256kb")

    def tx_bytes(self, index: int) -> int:
        out = _run(["ip", "-n", self.namespaces[index], "-s", "-j", "link", "show", self.links[index]]).stdout
        return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])

    def close(self) -> None:
        for ns in self._created:  # deleting a namespace deletes its end of the veth (and the pair)
            _run(["ip", "netns", "del", ns], check=False)
        self._created = []


def run_variant(name: str, args, network: Optional[VethPair], port: int) -> Dict:
    out = Path(tempfile.mkdtemp(prefix=f"bench_pipeline_{name.replace('+', '_')}_"))
    common = [sys.executable, "-m", "neorec", "train", "--config", str(ROOT / "configs" / "default.toml"),
              "--max-steps", str(args.steps), "--no-progress", "--profile", "--output-dir", str(out),
              "--set", f"data.batch_size={args.batch}", "--set", "data.synthetic.num_eval_samples=2000",
              "--set", "train.num_threads=1", *VARIANTS[name]]
    procs = []
    tx_before = [network.tx_bytes(i) for i in range(2)] if network else [0, 0]
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                   MASTER_PORT=str(port), PYTHONPATH=str(ROOT))
        prefix: List[str] = []
        if network is not None:
            env.update(MASTER_ADDR=network.addresses[0], GLOO_SOCKET_IFNAME=network.links[rank])
            prefix = ["ip", "netns", "exec", network.namespaces[rank]]
        else:
            env.update(MASTER_ADDR="127.0.0.1", GLOO_SOCKET_IFNAME="lo")
        procs.append(subprocess.Popen(prefix + common, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    try:
        outputs = [p.communicate(timeout=args.timeout)[0] for p in procs]
        for rank, (p, text) in enumerate(zip(procs, outputs)):
            if p.returncode != 0:
                raise RuntimeError(f"{name}: rank {rank} failed (exit {p.returncode}):\n{text[-3000:]}")
        tx = [network.tx_bytes(i) - tx_before[i] for i in range(2)] if network else [0, 0]
        final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
        timeline = json.loads((out / "timeline.json").read_text())
    finally:  # a timeout left both ranks training on as orphans
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(out, ignore_errors=True)
    phases = timeline["phases"]
    blocked = timeline["exposed_comm"]["ms_per_step_by_collective"]
    return {"input_blocked_ms": sum(v for k, v in blocked.items() if k.startswith("input_dist")),
            "output_blocked_ms": blocked.get("output_dist", 0.0),
            "gradient_blocked_ms": blocked.get("output_dist.backward", 0.0),
            "qps": final["qps"], "ne": final["ne"], "step_ms": timeline["step_ms"],
            "input_dist_ms": phases["input_dist"]["ms_per_step"],
            "output_dist_ms": phases["output_dist"]["ms_per_step"],
            "exposed_comm_fraction": timeline["exposed_comm"]["fraction"],
            "exposed_comm_ms": timeline["exposed_comm"]["ms_per_step"],
            "output_dist_bytes_per_step": timeline["comm_bytes"].get("output_dist", 0) / args.steps,
            "output_dist_backward_bytes_per_step": timeline["comm_bytes"].get("output_dist.backward", 0) / args.steps,
            "input_dist_bytes_per_step": sum(v for k, v in timeline["comm_bytes"].items()
                                             if k.startswith("input_dist")) / args.steps,
            "veth_tx_bytes_per_step": sum(tx) / args.steps}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", choices=["netns", "loopback"], default="netns",
                        help="netns: 2 namespaces over a shaped veth pair (default); loopback: the host's lo")
    parser.add_argument("--rate", default="1gbit", help="tc rate of each veth end (default 1gbit)")
    parser.add_argument("--delay-ms", type=float, default=0.5, help="netem delay per direction (default 0.5)")
    parser.add_argument("--steps", type=at_least(1), default=30, help="training steps per run (default 30)")
    parser.add_argument("--batch", type=at_least(1), default=1024, help="samples per rank per step (default 1024)")
    parser.add_argument("--repeats", type=at_least(1), default=2, help="rounds over the variants (default 2)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated subset of "
                        + ", ".join(VARIANTS))
    parser.add_argument("--timeout", type=number(0, above=True), default=900.0,
                        help="seconds per run before it is killed, > 0 (default 900)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"unknown variants {unknown}; variants are {list(VARIANTS)}")
    if not names:
        parser.error(f"argument --variants: no variant named; variants are {list(VARIANTS)}")
    check_out(parser, args.out)

    network, network_note = None, "loopback (requested)"
    if args.network == "netns":
        try:
            network = VethPair(args.rate, args.delay_ms)
            network_note = "; ".join(["veth pair between 2 network namespaces", *network.shaping, *network.notes])
        except (subprocess.CalledProcessError, OSError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            command = " ".join(exc.cmd) if hasattr(exc, "cmd") else ""
            network_note = f"LOOPBACK FALLBACK: namespaces could not be created ({command}: {detail.strip()})"
    print(f"network: {network_note}", flush=True)
    runs: Dict[str, List[Dict]] = {n: [] for n in names}
    try:
        port = 29000 + secrets.randbelow(2000)
        for repeat in range(args.repeats):
            for name in names:
                port += 1
                start = time.perf_counter()
                result = run_variant(name, args, network, port)
                runs[name].append(result)
                print(f"round {repeat + 1} {name:<15} {result['qps']:>9,.0f} samples/s  "
                      f"step {result['step_ms']:.1f} ms  input_dist {result['input_dist_ms']:.2f} ms "
                      f"(blocked {result['input_blocked_ms']:.2f})  exposed "
                      f"{100 * result['exposed_comm_fraction']:.1f}%  ({time.perf_counter() - start:.0f} s)",
                      flush=True)
    finally:
        if network is not None:
            network.close()

    summary = {name: {key: statistics.median(r[key] for r in results) for key in results[0]}
               for name, results in runs.items() if results}
    print(f"\n{'variant':<16}{'samples/s':>11}{'step ms':>9}{'in_dist ms':>11}{'in blocked':>11}{'out_dist ms':>12}"
          f"{'exposed':>9}"
          f"{'out B/step':>12}{'grad B/step':>12}{'veth B/step':>13}{'NE':>8}")
    for name, m in summary.items():
        print(f"{name:<16}{m['qps']:>11,.0f}{m['step_ms']:>9.1f}{m['input_dist_ms']:>11.2f}"
              f"{m['input_blocked_ms']:>11.2f}"
              f"{m['output_dist_ms']:>12.2f}"
              f"{100 * m['exposed_comm_fraction']:>8.1f}%{m['output_dist_bytes_per_step']:>12,.0f}"
              f"{m['output_dist_backward_bytes_per_step']:>12,.0f}{m['veth_tx_bytes_per_step']:>13,.0f}{m['ne']:>8.4f}")
    ratios = {}
    if "plain" in summary and "pipeline" in summary:
        plain, piped = summary["plain"], summary["pipeline"]
        ratios["pipeline_speedup"] = piped["qps"] / plain["qps"]
        # the input all-to-all time: time blocked on it (header exchange + waits on the ids)
        ratios["input_all_to_all_hidden_fraction"] = 1.0 - piped["input_blocked_ms"] / max(plain["input_blocked_ms"],
                                                                                            1e-9)
        ratios["input_dist_phase_reduction"] = 1.0 - piped["input_dist_ms"] / max(plain["input_dist_ms"], 1e-9)
        for codec in ("fp16", "bf16", "int8"):
            if f"pipeline+{codec}" in summary:
                entry = summary[f"pipeline+{codec}"]
                ratios[f"{codec}_output_bytes_ratio"] = (entry["output_dist_bytes_per_step"]
                                                         / piped["output_dist_bytes_per_step"])
                ratios[f"{codec}_gradient_bytes_ratio"] = (entry["output_dist_backward_bytes_per_step"]
                                                          / piped["output_dist_backward_bytes_per_step"])
                ratios[f"{codec}_speedup_vs_fp32"] = entry["qps"] / piped["qps"]
    for key, value in ratios.items():
        print(f"{key}: {value:.3f}")
    report = {"machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "torch": torch.__version__, "cpus": os.cpu_count()},
              "command": " ".join(sys.argv), "network": network_note, "steps": args.steps, "batch_per_rank": args.batch,
              "summary": summary, "ratios": ratios, "runs": runs}
    if args.out:
        path = Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(report, indent=1))
        os.replace(tmp, path)


if __name__ == "__main__":
    main()
