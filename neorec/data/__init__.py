"""Data ingestion: sources of ``Batch(dense, sparse KeyedJaggedTensor, labels)`` and a prefetcher.

    from neorec.data import make_data_source, PrefetchLoader
    source = make_data_source(cfg.data)            # "synthetic", "criteo" or "movielens"
    tables = source.tables(embedding_dim=16)       # TableConfig per sparse feature
    with PrefetchLoader(source.train_batches(512, epoch=0)) as loader:
        for batch in loader:
            ...
"""

from neorec.data.batch import Batch
from neorec.data.config import CriteoConfig, DataConfig, MovieLensConfig, SyntheticConfig
from neorec.data.loader import PrefetchLoader
from neorec.data.source import DataSource, make_data_source

__all__ = [
    "Batch",
    "CriteoConfig",
    "DataConfig",
    "DataSource",
    "MovieLensConfig",
    "PrefetchLoader",
    "SyntheticConfig",
    "make_data_source",
]
