"""MovieLens-100k as click data: label = rating >= 4, split in time.

    neorec train --config configs/movielens.toml

    from neorec.data.config import MovieLensConfig
    from neorec.data.movielens import MovieLensSource
    source = MovieLensSource(MovieLensConfig(path="../shared/data/ml-100k"))

The directory holds the data in one of two layouts:

* GroupLens' own, as unpacked from ``ml-100k.zip``: ``u.data`` (user, item, rating, timestamp,
  tab-separated), ``u.user`` (user|age|gender|occupation|zip), ``u.item`` (item|title|release
  date|video release date|URL|one 0/1 flag per genre) and ``u.genre`` (name|index), Latin-1;
* RecBole's atomic files, tab-separated with typed headers (``user_id:token`` ...):
  ``<name>.inter`` (user_id, item_id, rating, timestamp), ``<name>.user`` (user_id, age, gender,
  occupation, zip_code) and ``<name>.item`` (item_id, release_year, class = space-separated genres).

Both give the same features, ids and batches (a test builds one small data set in both layouts).

Sparse features (KeyedJaggedTensor keys, in order): user, item, age (bucket: <18, 18-24, 25-34,
35-44, 45-49, 50-55, 56+), gender, occupation, zip (first 3 characters), release_year, genres (a
multi-hot bag with every genre of the movie). Ids come from vocabularies built from the files in
sorted token order; id 0 is reserved for an unknown or missing value (e.g. release year "unknown").
An interaction whose user or item is not in the user or item file is an error, not id 0.

Dense features (``dense_names``): the user's age and the movie's release year, standardised
(unknown year = 0), and log(1 + count) of the item's and of the user's interactions strictly before
this one in time (what is known when it happens; the same for training and eval interactions, so a
user first seen in the eval period looks as a new user did in training), standardised over the
training interactions.

Split: interactions sorted by timestamp (stable); the last ``eval_fraction`` are the eval set, the
cut moved back to the first interaction of its timestamp so that every eval interaction is later
than every training one.
Training batches are shuffled every epoch by a generator seeded by (seed, epoch).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Dict, Iterator, List, Sequence

import numpy as np
import torch

from neorec.data.batch import Batch
from neorec.data.config import MOVIELENS_FEATURES, MovieLensConfig
from neorec.data.source import EpochOrder, batch_ranges, check_batch_args, one_table_per_feature
from neorec.embedding.config import TableConfig
from neorec.sparse.jagged import KeyedJaggedTensor

FEATURES = MOVIELENS_FEATURES
DENSE_NAMES = ["age", "release_year", "item_popularity", "user_activity"]
AGE_BUCKETS = [(18, "<18"), (25, "18-24"), (35, "25-34"), (45, "35-44"), (50, "45-49"), (56, "50-55")]
REQUIRED = {
    "inter": ["user_id", "item_id", "rating", "timestamp"],
    "user": ["user_id", "age", "gender", "occupation", "zip_code"],
    "item": ["item_id", "release_year", "class"],
}
_EXPECTED = (
    "a directory with GroupLens' MovieLens-100k files (u.data, u.user, u.item, u.genre, as unpacked "
    "from ml-100k.zip) or RecBole's <name>.inter (user_id, item_id, rating, timestamp), <name>.user "
    "(user_id, age, gender, occupation, zip_code) and <name>.item (item_id, release_year, class): "
    "tab-separated, with typed headers such as 'user_id:token'"
)
GROUPLENS = {"inter": "u.data", "user": "u.user", "item": "u.item", "genre": "u.genre"}
Columns = Dict[str, list]  # column name -> its values (text), LINE -> each row's line number
LINE = "#line"


def _find_file(directory: Path, kind: str) -> Path:
    preferred = directory / f"{directory.name}.{kind}"
    if preferred.is_file():
        return preferred
    found = sorted(directory.glob(f"*.{kind}"))
    if len(found) != 1:
        what = "no" if not found else f"{len(found)} ({', '.join(p.name for p in found)})"
        raise FileNotFoundError(f"MovieLens directory {directory} has {what} *.{kind} file; expected {_EXPECTED}")
    return found[0]


def read_table(path: Path, required: Sequence[str]) -> Columns:
    """Columns (by header name without its ``:type``) of a typed-header TSV file; blank lines are
    skipped (``LINE`` holds the line numbers of the rows kept), fields are stripped of surrounding
    whitespace ("M " was a gender of its own). UTF-8, else Latin-1: every byte stays itself (an
    undecodable one became U+FFFD, so "t\xe9ch" and "t\xe8ch" were one occupation)."""
    data = path.read_bytes().removeprefix(b"\xef\xbb\xbf")  # a byte-order mark is not the header's
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("latin-1")
    lines = [line.rstrip("\r") for line in text.split("\n")]  # (not splitlines: Latin-1's \x85 ends no line)
    if not text:
        raise ValueError(f"{path}: empty file; expected a header line such as 'user_id:token\\t...'")
    names = [h.split(":", 1)[0].strip() for h in lines[0].split("\t")]
    missing = [c for c in required if c not in names]
    if missing:
        raise ValueError(f"{path}: header lacks columns {missing}; found {names}; expected {_EXPECTED}")
    numbers = [number for number, line in enumerate(lines[1:], 2) if line]
    rows = [[field.strip() for field in lines[number - 1].split("\t")] for number in numbers]
    for number, row in zip(numbers, rows):
        if len(row) != len(names):
            raise ValueError(f"{path}:{number}: expected {len(names)} tab-separated fields "
                             f"({names}), found {len(row)}")
    columns = list(zip(*rows)) if rows else [()] * len(names)
    return {**{name: list(columns[k]) for k, name in enumerate(names)}, LINE: numbers}


def _grouplens_rows(path: Path, separator: str, width: int) -> List[list]:
    """The fields of every non-empty line of a headerless GroupLens file (Latin-1), its line
    number appended."""
    if not path.is_file():
        raise FileNotFoundError(f"MovieLens directory {path.parent} has u.data but no {path.name}; expected {_EXPECTED}")
    rows = []
    with open(path, encoding="latin-1") as f:
        for number, line in enumerate(f, 1):
            line = line.rstrip("\r\n")
            if not line:
                continue
            fields = [field.strip() for field in line.split(separator)] if separator else line.split()
            if len(fields) != width:
                raise ValueError(f"{path}:{number}: expected {width} {separator or 'whitespace'}-separated "
                                 f"fields, found {len(fields)}")
            rows.append(fields + [number])
    return rows


def read_grouplens(directory: Path) -> Dict[str, Columns]:
    """GroupLens' ml-100k files as the columns of the RecBole layout (``REQUIRED``'s names): genres
    become the space-separated names of the flagged genres, the release date its year."""
    genre_path = directory / GROUPLENS["genre"]
    genre_rows = _grouplens_rows(genre_path, "|", 2)
    for row in genre_rows:
        if not row[1].isdigit():
            raise ValueError(f"{genre_path}:{row[-1]}: genre {row[0]!r} has index {row[1]!r}, expected a number")
    genres = [row[0] for row in sorted(genre_rows, key=lambda row: int(row[1]))]
    inter_rows = _grouplens_rows(directory / GROUPLENS["inter"], "", 4)
    user_rows = _grouplens_rows(directory / GROUPLENS["user"], "|", 5)
    item_path = directory / GROUPLENS["item"]
    item_rows = _grouplens_rows(item_path, "|", 5 + len(genres))
    for row in item_rows:
        if any(flag not in ("0", "1") for flag in row[5:-1]):
            raise ValueError(f"{item_path}:{row[-1]}: item {row[0]}: genre flags must be 0 or 1, found {row[5:-1]}")

    def columns(rows: List[list], names: Sequence[str]) -> Columns:
        return {**{name: [row[k] for row in rows] for k, name in enumerate(names)}, LINE: [row[-1] for row in rows]}

    items = columns(item_rows, ["item_id", "title", "release_date"])
    items["release_year"] = [date.strip()[-4:] if date.strip() else "unknown" for date in items.pop("release_date")]
    items["class"] = [" ".join(g for g, flag in zip(genres, row[5:-1]) if flag == "1") for row in item_rows]
    return {"inter": columns(inter_rows, REQUIRED["inter"]), "user": columns(user_rows, REQUIRED["user"]),
            "item": items}


def _numbers(path: Path, name: str, texts: List[str], lines: List[int]) -> np.ndarray:
    """``texts`` as finite numbers; ``lines``: the line number of each, for the error (float()
    takes "nan" and "inf": a NaN rating became label 0, a NaN timestamp sorted into the eval set)."""
    try:
        values = np.array(texts, dtype=np.float64)
    except ValueError:
        values = None
    if values is None or not np.isfinite(values).all():
        for number, text in zip(lines, texts):
            try:
                value = float(text)
            except ValueError:
                raise ValueError(f"{path}:{number}: column {name!r} holds {text!r}, expected a number") from None
            if not math.isfinite(value):
                raise ValueError(f"{path}:{number}: column {name!r} holds {text!r}, expected a finite number")
        values = np.array([float(text) for text in texts], dtype=np.float64)
    return values


def _check_unique(path: Path, kind: str, ids: List[str], lines: List[int]) -> None:
    """Refuse a user (item) file that lists an id twice (the last row silently won)."""
    first: Dict[str, int] = {}
    for token, number in zip(ids, lines):
        if token in first:
            raise ValueError(f"{path}:{number}: {kind} {token!r} is listed again (first on line {first[token]}); "
                             f"each {kind} must have one row")
        first[token] = number


def _prior_counts(keys: np.ndarray, times: np.ndarray) -> np.ndarray:
    """For each interaction, how many interactions of the same key (user or item) have an earlier
    time: what a count feature may know when the interaction happens."""
    order = np.lexsort((times, keys))  # by key, then time
    k, t = keys[order], times[order]
    index = np.arange(k.size)
    new_key = np.ones(k.size, dtype=bool)
    new_key[1:] = k[1:] != k[:-1]
    new_time = new_key.copy()
    new_time[1:] |= t[1:] != t[:-1]
    key_start = np.maximum.accumulate(np.where(new_key, index, 0))
    time_start = np.maximum.accumulate(np.where(new_time, index, 0))  # ties: the count at the first of them
    counts = np.empty(k.size, dtype=np.int64)
    counts[order] = time_start - key_start
    return counts


def _vocabulary(tokens: Sequence[str]) -> Dict[str, int]:
    """Token -> id in 1.. (sorted order); 0 is left for unknown values."""
    return {token: i + 1 for i, token in enumerate(sorted(set(tokens)))}


def _check_known(inter_path: Path, kind: str, ids: List[str], vocab: Dict[str, int], table_path: Path) -> None:
    """Refuse interactions whose user (item) is not in the user (item) file."""
    unknown = [token for token in ids if token not in vocab]
    if unknown:
        distinct = list(dict.fromkeys(unknown))
        shown = ", ".join(repr(t) for t in distinct[:5]) + (" ..." if len(distinct) > 5 else "")
        article = "an" if kind == "item" else "a"
        raise ValueError(f"{inter_path}: {len(unknown)} of {len(ids)} interactions name {article} {kind} missing "
                         f"from {table_path} ({kind} ids {shown}); add those {kind}s to {table_path.name} or "
                         "remove their interactions")


def _age_bucket(age: float) -> str:
    for upper, name in AGE_BUCKETS:
        if age < upper:
            return name
    return "56+"


def _standardise(x: np.ndarray, reference: np.ndarray) -> np.ndarray:
    std = float(reference.std()) if reference.size else 0.0
    mean = float(reference.mean()) if reference.size else 0.0
    return (x - mean) / (std if std > 0 else 1.0)


class MovieLensSource:
    """MovieLens interactions as click data (see the module docstring)."""

    name = "movielens"

    def __init__(self, cfg: MovieLensConfig) -> None:
        self.cfg = cfg
        directory = Path(cfg.path)
        if not directory.is_dir():
            relative = "" if directory.is_absolute() else f", relative to {Path.cwd()}"
            raise FileNotFoundError(f"MovieLens directory not found: {directory} (data.movielens.path{relative}); "
                                    f"expected {_EXPECTED}")
        if (directory / GROUPLENS["inter"]).is_file():
            paths = {kind: directory / GROUPLENS[kind] for kind in REQUIRED}
            tables = read_grouplens(directory)
        else:
            paths = {kind: _find_file(directory, kind) for kind in REQUIRED}
            tables = {kind: read_table(paths[kind], REQUIRED[kind]) for kind in REQUIRED}
        inter, users, items = tables["inter"], tables["user"], tables["item"]

        def numbers(kind: str, name: str, texts: List[str]) -> np.ndarray:
            return _numbers(paths[kind], name, texts, tables[kind][LINE])

        self.feature_names = cfg.feature_names()
        self.dense_names = list(DENSE_NAMES)
        self.num_dense = len(DENSE_NAMES)

        # users: attribute ids indexed by the user's id (row 0 = unknown user)
        _check_unique(paths["user"], "user", users["user_id"], users[LINE])
        _check_unique(paths["item"], "item", items["item_id"], items[LINE])
        user_vocab = _vocabulary(users["user_id"])
        ages = numbers("user", "age", users["age"])
        attributes = {
            "age": [_age_bucket(a) for a in ages], "gender": users["gender"],
            "occupation": users["occupation"], "zip": [z.strip()[:3] for z in users["zip_code"]],
        }
        self.vocabularies: Dict[str, Dict[str, int]] = {"user": user_vocab}
        user_rows = np.array([user_vocab[u] for u in users["user_id"]], dtype=np.int64)
        self._user_attr: Dict[str, np.ndarray] = {}
        for name, tokens in attributes.items():
            vocab = self.vocabularies[name] = _vocabulary(tokens)
            table = np.zeros(len(user_vocab) + 1, dtype=np.int64)
            table[user_rows] = [vocab[t] for t in tokens]
            self._user_attr[name] = table
        user_age = np.zeros(len(user_vocab) + 1)
        user_age[user_rows] = _standardise(ages, ages)

        # items: release year, genres (CSR), indexed by the item's id (row 0 = unknown item)
        item_vocab = self.vocabularies["item"] = _vocabulary(items["item_id"])
        item_rows = np.array([item_vocab[i] for i in items["item_id"]], dtype=np.int64)
        years = [y.strip() for y in items["release_year"]]
        known = [y for y in years if y.isdigit()]
        year_vocab = self.vocabularies["release_year"] = _vocabulary(known)
        self._item_year = np.zeros(len(item_vocab) + 1, dtype=np.int64)
        self._item_year[item_rows] = [year_vocab.get(y, 0) for y in years]
        year_values = np.array([float(y) if y.isdigit() else np.nan for y in years])
        item_year_dense = np.zeros(len(item_vocab) + 1)
        item_year_dense[item_rows] = np.nan_to_num(_standardise(year_values, year_values[~np.isnan(year_values)]))
        genre_lists = [g.split() for g in items["class"]]
        genre_vocab = self.vocabularies["genres"] = _vocabulary([g for gs in genre_lists for g in gs])
        bags: List[List[int]] = [[0] for _ in range(len(item_vocab) + 1)]
        for row, genres in zip(item_rows.tolist(), genre_lists):
            bags[row] = [genre_vocab[g] for g in genres] or [0]
        self._genre_lengths = np.array([len(b) for b in bags], dtype=np.int64)
        self._genre_offsets = np.concatenate([[0], np.cumsum(self._genre_lengths)])
        self._genre_values = np.array([g for b in bags for g in b], dtype=np.int64)

        # interactions, sorted by time
        ratings = numbers("inter", "rating", inter["rating"])
        timestamps = numbers("inter", "timestamp", inter["timestamp"])
        order = np.argsort(timestamps, kind="stable")
        self.timestamps = timestamps[order]
        _check_known(paths["inter"], "user", inter["user_id"], user_vocab, paths["user"])
        _check_known(paths["inter"], "item", inter["item_id"], item_vocab, paths["item"])
        self._user = np.array([user_vocab[u] for u in inter["user_id"]], dtype=np.int64)[order]
        self._item = np.array([item_vocab[i] for i in inter["item_id"]], dtype=np.int64)[order]
        self._labels = (ratings[order] >= cfg.min_rating_positive).astype(np.float32)
        num = order.size
        cut = num - int(round(num * cfg.eval_fraction))
        wanted = cut
        if 0 < cut < num:  # not inside a run of equal timestamps: the eval set is later than training
            cut = int(np.searchsorted(self.timestamps, self.timestamps[cut], side="left"))
        self._num_train = cut
        if self._num_train <= 0 or num == 0:
            tied = f" (all before the cut share timestamp {self.timestamps[0]:.0f})" if cut < wanted else ""
            raise ValueError(f"{paths['inter']}: {num} interactions leave no training data "
                             f"with eval_fraction {cfg.eval_fraction}{tied}")
        if self._num_train == num:
            raise ValueError(f"{paths['inter']}: {num} interactions leave no eval data with eval_fraction "
                             f"{cfg.eval_fraction}: raise data.movielens.eval_fraction")

        train = slice(0, self._num_train)
        # counts known when each interaction happens (whole-period training counts told a training
        # interaction its user's future, and put eval's new users below every training value)
        item_pop = np.log1p(_prior_counts(self._item, self.timestamps))
        user_act = np.log1p(_prior_counts(self._user, self.timestamps))
        self._dense = np.stack([
            user_age[self._user], item_year_dense[self._item],
            _standardise(item_pop, item_pop[train]), _standardise(user_act, user_act[train]),
        ], axis=1).astype(np.float32)

    # ------------------------------------------------------------------------------ interface
    def vocabulary_sizes(self) -> List[int]:
        """Rows of each feature's table (vocabulary size + 1 for the unknown id 0)."""
        return [len(self.vocabularies[f]) + 1 for f in self.feature_names]

    def tables(self, embedding_dim: int, pooling: str = "sum") -> List[TableConfig]:
        return one_table_per_feature(self.feature_names, self.vocabulary_sizes(), embedding_dim, pooling)

    def num_train_samples(self) -> int:
        return self._num_train

    def num_eval_samples(self) -> int:
        return self._labels.size - self._num_train

    def train_batches(self, batch_size: int, epoch: int = 0, start_batch: int = 0) -> Iterator[Batch]:
        check_batch_args(batch_size, epoch, start_batch)
        order = EpochOrder(self._num_train, True, self.cfg.seed, epoch)
        for start, stop in batch_ranges(self._num_train, batch_size, start_batch):
            yield self._batch(order.rows(start, stop))

    def eval_batches(self, batch_size: int) -> Iterator[Batch]:
        check_batch_args(batch_size)
        for start, stop in batch_ranges(self.num_eval_samples(), batch_size):
            yield self._batch(np.arange(start + self._num_train, stop + self._num_train))

    def train_timestamps(self) -> np.ndarray:
        return self.timestamps[: self._num_train]

    def eval_timestamps(self) -> np.ndarray:
        return self.timestamps[self._num_train :]

    # ------------------------------------------------------------------------------ batching
    def _batch(self, rows: np.ndarray) -> Batch:
        users, items = self._user[rows], self._item[rows]
        one_hot = [users, items, self._user_attr["age"][users], self._user_attr["gender"][users],
                   self._user_attr["occupation"][users], self._user_attr["zip"][users], self._item_year[items]]
        genre_lengths = self._genre_lengths[items]
        first = np.cumsum(genre_lengths) - genre_lengths
        positions = np.repeat(self._genre_offsets[items] - first, genre_lengths) + np.arange(genre_lengths.sum())
        num = rows.size
        values = np.concatenate(one_hot + [self._genre_values[positions]])
        lengths = np.concatenate([np.ones(num * len(one_hot), dtype=np.int64), genre_lengths])
        sparse = KeyedJaggedTensor(self.feature_names, torch.from_numpy(values), torch.from_numpy(lengths),
                                   batch_size=num, validate=False)
        return Batch(torch.from_numpy(self._dense[rows]), sparse, torch.from_numpy(self._labels[rows]))
