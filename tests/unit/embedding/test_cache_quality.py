"""Low-precision row stores keep model quality: a DLRM trained with its tables cached (10% of
rows) over fp16 / bf16 / int8 stores reaches an NE within 0.3% (relative) of the fp32 run, on the
synthetic data and on MovieLens-100k. Small runs, but real training: the caches are far smaller
than the tables, so rows go through the low-precision store (stochastic rounding) many times.

    python -m pytest tests/unit/embedding/test_cache_quality.py -q
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path

import pytest
import torch

from neorec.config import load_config
from neorec.embedding.cached import CachedEmbeddingBagCollection
from neorec.train.trainer import Trainer

ROOT = Path(__file__).resolve().parents[3]
MOVIELENS = ROOT.parent / "shared" / "data" / "ml-100k"
TOLERANCE = 0.003  # relative NE


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train(config: str, overrides, location=None):
    settings = ["train.progress=false", "train.output_dir=", *overrides]
    if location is not None:
        settings += [f"embedding.location.{key}={value}" for key, value in location.items()]
    trainer = Trainer(load_config(ROOT / config, settings), out=io.StringIO())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # caches growing to one batch's rows
        result = trainer.fit()
    collection = trainer.model.sparse_arch
    stats = collection.cache_stats() if isinstance(collection, CachedEmbeddingBagCollection) else {}
    if isinstance(collection, CachedEmbeddingBagCollection):
        collection.close()
    return result.final_eval["ne"], stats


def check_precisions(tmp_path, config, overrides, precisions):
    reference, _ = train(config, overrides)
    results = {}
    for precision, where in precisions:
        location = {"default": f'"{where}"', "precision": f'"{precision}"', "cache_fraction": 0.1,
                    "ssd_dir": f'"{tmp_path / precision}"'}
        ne, stats = train(config, overrides, location)
        write_backs = sum(s["write_backs"] for s in stats.values())
        rows = sum(s["lookups"] for s in stats.values())
        assert write_backs > 0.1 * rows, (precision, stats)  # rows really went through the store
        results[precision] = ne
    for precision, ne in results.items():
        assert abs(ne - reference) <= TOLERANCE * reference, (precision, ne, reference, results)


def test_low_precision_stores_keep_ne_on_synthetic_data(tmp_path):
    check_precisions(tmp_path, "configs/tiny.toml", ["data.synthetic.num_eval_samples=20000"],
                     [("fp16", "cached_dram"), ("bf16", "cached_dram"), ("int8", "cached_ssd")])


@pytest.mark.skipif(not MOVIELENS.is_dir(), reason="MovieLens-100k not found next to the repository")
def test_low_precision_stores_keep_ne_on_movielens(tmp_path):
    check_precisions(tmp_path, "configs/movielens.toml",
                     [f'data.movielens.path="{MOVIELENS}"', "train.epochs=1", "data.batch_size=1024"],
                     [("fp16", "cached_ssd"), ("int8", "cached_dram")])
