"""MovieLens-100k in GroupLens' own layout (u.data, u.user, u.item, u.genre) and in RecBole's
atomic files give the same source: one small data set written both ways."""

from pathlib import Path

import numpy as np
import pytest
import torch

from neorec.data import MovieLensConfig
from neorec.data.movielens import DENSE_NAMES, MovieLensSource

GENRES = ["unknown", "Action", "Children's", "Comedy"]
USERS = [("1", "24", "M", "technician", "85711"), ("2", "53", "F", "other", "94043"),
         ("3", "17", "M", "student", "T8H1N"), ("7", "57", "M", "administrator", "91344")]
# item, title (Latin-1 on disk in GroupLens' layout), release date, genre names
ITEMS = [("1", "Toy Story (1995)", "01-Jan-1995", ["Children's", "Comedy"]),
         ("2", "GoldenEye (1995)", "01-Jan-1995", ["Action"]),
         ("3", "Señorita (1971)", "01-Jan-1971", ["unknown"]),
         ("4", "unknown", "", ["unknown"]),
         ("5", "Die Hard (1988)", "01-Jan-1988", ["Action", "Comedy"])]
RNG = np.random.default_rng(3)
RATINGS = [(str(RNG.choice(["1", "2", "3", "7"])), str(RNG.integers(1, 6)), str(RNG.integers(1, 6)),
            str(880_000_000 + int(t))) for t in RNG.permutation(60) * 1000]


def write_grouplens(directory: Path, ratings=RATINGS, users=USERS, items=ITEMS) -> Path:
    directory.mkdir()
    (directory / "u.data").write_text("".join("\t".join(r) + "\n" for r in ratings))
    (directory / "u.user").write_text("".join("|".join(u) + "\n" for u in users))
    (directory / "u.genre").write_text("".join(f"{g}|{i}\n" for i, g in enumerate(GENRES)) + "\n")
    lines = [f"{item}|{title}|{date}||http://example.invalid/{item}|"
             + "|".join("1" if g in genres else "0" for g in GENRES) + "\n"
             for item, title, date, genres in items]
    (directory / "u.item").write_bytes("".join(lines).encode("latin-1"))
    return directory


def write_recbole(directory: Path, ratings=RATINGS, users=USERS, items=ITEMS) -> Path:
    directory.mkdir()
    name = directory.name
    (directory / f"{name}.inter").write_text(
        "user_id:token\titem_id:token\trating:float\ttimestamp:float\n" + "".join("\t".join(r) + "\n" for r in ratings))
    (directory / f"{name}.user").write_text(
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        + "".join("\t".join(u) + "\n" for u in users))
    (directory / f"{name}.item").write_text(
        "item_id:token\tmovie_title:token_seq\trelease_year:token\tclass:token_seq\n"
        + "".join(f"{item}\t{title}\t{date[-4:] if date else 'unkonwn'}\t{' '.join(genres)}\n"
                  for item, title, date, genres in items))
    return directory


def batches(source: MovieLensSource):
    return list(source.train_batches(16, epoch=1)) + list(source.eval_batches(16))


def test_both_layouts_give_the_same_source(tmp_path):
    grouplens = MovieLensSource(MovieLensConfig(path=str(write_grouplens(tmp_path / "ml-100k"))))
    recbole = MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-tiny"))))
    assert grouplens.vocabularies == recbole.vocabularies
    assert grouplens.vocabularies["genres"] == {g: i + 1 for i, g in enumerate(sorted(GENRES))}
    assert grouplens.vocabularies["release_year"] == {"1971": 1, "1988": 2, "1995": 3}  # item 4: unknown
    assert grouplens.vocabulary_sizes() == recbole.vocabulary_sizes()
    assert grouplens.num_train_samples() == recbole.num_train_samples() == 48
    ours, theirs = batches(grouplens), batches(recbole)
    assert len(ours) == len(theirs) == 4
    for a, b in zip(ours, theirs):
        assert torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.sparse.lengths, b.sparse.lengths)
    # Die Hard (item "5") is an Action Comedy in both
    genres, item = grouplens.vocabularies["genres"], grouplens.vocabularies["item"]["5"]
    bags = {int(i): sorted(g) for batch in ours
            for i, g in zip(batch.sparse["item"].values, batch.sparse["genres"].to_list())}
    assert bags[item] == sorted([genres["Action"], genres["Comedy"]])


def test_grouplens_errors_name_file_and_line(tmp_path):
    directory = write_grouplens(tmp_path / "ml-100k")
    (directory / "u.genre").unlink()
    with pytest.raises(FileNotFoundError, match="has u.data but no u.genre"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
    (directory / "u.genre").write_text("".join(f"{g}|{i}\n" for i, g in enumerate(GENRES)))
    text = (directory / "u.data").read_text().splitlines()
    text[4] = "1\t2\t3"
    (directory / "u.data").write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"u.data:5: expected 4 whitespace-separated fields, found 3"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
    text[4] = "1\t2\tfive\t881250949"
    (directory / "u.data").write_text("\n".join(text) + "\n")
    with pytest.raises(ValueError, match=r"u.data:5: column 'rating' holds 'five', expected a number"):
        MovieLensSource(MovieLensConfig(path=str(directory)))


@pytest.mark.parametrize("layout", ["grouplens", "recbole"])
def test_error_line_numbers_count_the_blank_lines_skipped(tmp_path, layout):
    """Blank lines are skipped, but the line an error names is the file's own (it was the row's
    index among the non-blank rows, or counted blanks only part of the way)."""
    directory = (write_grouplens if layout == "grouplens" else write_recbole)(tmp_path / "ml-tiny")
    path = directory / ("u.data" if layout == "grouplens" else "ml-tiny.inter")
    lines = path.read_text().splitlines()
    head = 1 if layout == "recbole" else 0  # the header line
    good = lines[head:head + 2]
    for bad, what in [("1\t2\t3", "expected 4 .*fields"), ("1\t2\tfive\t881250949", "column 'rating' holds 'five'")]:
        path.write_text("\n".join(lines[:head] + good + ["", ""] + [bad] + lines[head + 2:]) + "\n")
        number = head + len(good) + 3  # two blank lines, then the bad one
        with pytest.raises(ValueError, match=rf"{path.name}:{number}: {what}"):
            MovieLensSource(MovieLensConfig(path=str(directory)))
    path.write_text("\n".join(lines[:head] + good + ["", ""] + lines[head + 2:]) + "\n")
    assert MovieLensSource(MovieLensConfig(path=str(directory))).num_train_samples() > 0  # blanks alone are fine


def test_a_byte_order_mark_before_the_header_is_not_part_of_it(tmp_path):
    """Files saved by Windows tools start with a UTF-8 BOM; the first column was '\\ufeffuser_id'."""
    plain = MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-tiny"))))
    directory = write_recbole(tmp_path / "ml-bom")
    for path in directory.iterdir():
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    marked = MovieLensSource(MovieLensConfig(path=str(directory)))
    assert marked.vocabularies == plain.vocabularies and marked.num_train_samples() == plain.num_train_samples()


def test_missing_directory_or_file_is_explained(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match=r"MovieLens directory not found: .*nowhere \(data.movielens.path\); "
                                                r"expected .*u.data"):
        MovieLensSource(MovieLensConfig(path=str(tmp_path / "nowhere")))
    monkeypatch.chdir(tmp_path)  # the default path is relative: say to what
    with pytest.raises(FileNotFoundError, match=rf"ml-100k \(data.movielens.path, relative to {tmp_path}\)"):
        MovieLensSource(MovieLensConfig())
    partial = tmp_path / "ml-tiny"
    partial.mkdir()
    (partial / "ml-tiny.inter").write_text("user_id:token\titem_id:token\trating:float\ttimestamp:float\n1\t1\t5\t10\n")
    with pytest.raises(FileNotFoundError, match=r"has no \*\.user file"):
        MovieLensSource(MovieLensConfig(path=str(partial)))


@pytest.mark.parametrize("layout", ["grouplens", "recbole"])
def test_interactions_of_unknown_users_or_items_are_refused(tmp_path, layout):
    """Not mapped silently to the unknown id 0: the error names the files and the ids."""
    write = write_grouplens if layout == "grouplens" else write_recbole
    ratings = RATINGS + [("9", "1", "5", "880000001"), ("9", "2", "4", "880000002"), ("8", "3", "4", "880000003")]
    directory = write(tmp_path / "ml-tiny", ratings)
    user_file = "u.user" if layout == "grouplens" else "ml-tiny.user"
    with pytest.raises(ValueError, match=rf"3 of 63 interactions name a user missing from .*{user_file} "
                                         rf"\(user ids '9', '8'\); add those users to {user_file}"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
    directory = write(tmp_path / "ml-other", RATINGS + [("1", "6", "5", "880000001")])
    item_file = "u.item" if layout == "grouplens" else "ml-other.item"
    with pytest.raises(ValueError, match=rf"1 of 61 interactions name an item missing from .*{item_file} "
                                         r"\(item ids '6'\)"):
        MovieLensSource(MovieLensConfig(path=str(directory)))


def test_empty_eval_set_is_refused(tmp_path):
    directory = write_grouplens(tmp_path / "ml-100k", RATINGS[:2])  # 0.2 of 2 interactions rounds to none
    with pytest.raises(ValueError, match=r"u.data: 2 interactions leave no eval data with eval_fraction 0.2"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
    assert MovieLensSource(MovieLensConfig(path=str(directory), eval_fraction=0.5)).num_eval_samples() == 1


def test_count_features_know_only_earlier_interactions(tmp_path):
    """item_popularity / user_activity were log(1 + count over the whole training period): a training
    interaction saw its user's future, and a user new in the eval period got a value below every
    training one (17,048 of ml-100k's 20,000 eval interactions). Now each is the count of strictly
    earlier interactions, for training and eval alike; interactions at one timestamp share it."""
    ratings = [("1", "1", "5", "100"), ("1", "2", "4", "200"), ("2", "1", "3", "200"), ("1", "3", "4", "300"),
               ("2", "2", "5", "300"), ("3", "1", "4", "400"), ("1", "4", "2", "500"), ("3", "5", "1", "600"),
               ("7", "1", "5", "700"), ("7", "2", "5", "700")]
    source = MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-tiny", ratings)), eval_fraction=0.3))
    assert source.num_train_samples() == 7
    dense = np.concatenate([b.dense.numpy() for b in source.eval_batches(100)])
    train_rows = source._dense[: source.num_train_samples()]  # in time order (batches are shuffled)
    pop, act = DENSE_NAMES.index("item_popularity"), DENSE_NAMES.index("user_activity")

    def standardised(counts, train_counts):
        x, ref = np.log1p(counts), np.log1p(train_counts)
        return (x - ref.mean()) / ref.std()

    train_item = [0, 0, 1, 0, 1, 2, 0]  # item 1 at 100, 200 (tie with none of item 1's), 400; ...
    train_user = [0, 1, 0, 2, 1, 0, 3]
    np.testing.assert_allclose(train_rows[:, pop], standardised(train_item, train_item), rtol=1e-5)
    np.testing.assert_allclose(train_rows[:, act], standardised(train_user, train_user), rtol=1e-5)
    # eval: item 5 new (0 before), items 1 and 2 at 700 see 3 and 2 earlier; user 3 once before, user 7 new,
    # and user 7's two interactions at one timestamp both see 0 (not 0 and 1)
    np.testing.assert_allclose(dense[:, pop], standardised([0, 3, 2], train_item), rtol=1e-5)
    np.testing.assert_allclose(dense[:, act], standardised([1, 0, 0], train_user), rtol=1e-5)


def test_the_split_does_not_cut_a_timestamp_in_two(tmp_path):
    """With eval_fraction 0.25 of 8 the cut fell between two interactions of one timestamp."""
    ratings = [("1", str(i % 5 + 1), "4", str(t)) for i, t in enumerate([1, 2, 3, 4, 5, 6, 6, 7])]
    source = MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-tiny", ratings)), eval_fraction=0.25))
    assert source.num_train_samples() == 5 and source.num_eval_samples() == 3
    assert source.train_timestamps().max() < source.eval_timestamps().min()
    tied = [("1", "1", "4", "9")] * 4
    with pytest.raises(ValueError, match=r"4 interactions leave no training data with eval_fraction 0.2 "
                                         r"\(all before the cut share timestamp 9\)"):
        MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-tied", tied))))
    untied = [("1", "1", "4", "10"), ("1", "2", "4", "20")]  # no tie moved the cut: not blamed on one
    with pytest.raises(ValueError, match=r"2 interactions leave no training data with eval_fraction 0.8$"):
        MovieLensSource(MovieLensConfig(path=str(write_recbole(tmp_path / "ml-untied", untied)), eval_fraction=0.8))


@pytest.mark.parametrize("column, text", [("rating", "nan"), ("rating", "inf"), ("timestamp", "nan"), ("age", "-inf")])
def test_non_finite_numbers_are_refused_with_their_line(tmp_path, column, text):
    """float() takes them: a NaN rating was label 0, a NaN timestamp sorted into the eval set, a NaN
    age made every standardised age NaN and the run stopped on a non-finite loss naming no file."""
    ratings = [list(r) for r in RATINGS]
    users = [list(u) for u in USERS]
    if column == "age":
        users[1][1] = text
    else:
        ratings[4][2 if column == "rating" else 3] = text
    directory = write_recbole(tmp_path / "ml-tiny", [tuple(r) for r in ratings], users=[tuple(u) for u in users])
    where = r"ml-tiny.user:3" if column == "age" else r"ml-tiny.inter:6"
    with pytest.raises(ValueError, match=rf"{where}: column '{column}' holds '{text}', expected a finite number"):
        MovieLensSource(MovieLensConfig(path=str(directory)))


@pytest.mark.parametrize("layout", ["grouplens", "recbole"])
def test_a_user_or_item_listed_twice_is_refused(tmp_path, layout):
    """The last row silently won: a second row for user 1 changed its age, gender and occupation."""
    write = write_grouplens if layout == "grouplens" else write_recbole
    directory = write(tmp_path / "ml-users", RATINGS, users=USERS + [("1", "70", "F", "artist", "10001")])
    user_file, line = ("u.user", 5) if layout == "grouplens" else ("ml-users.user", 6)  # RecBole: a header line
    with pytest.raises(ValueError, match=rf"{user_file}:{line}: user '1' is listed again \(first on line {line - 4}\)"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
    directory = write(tmp_path / "ml-items", RATINGS, items=ITEMS + [("2", "Other (1950)", "01-Jan-1950", ["Comedy"])])
    item_file = "u.item" if layout == "grouplens" else "ml-items.item"
    with pytest.raises(ValueError, match=rf"{item_file}:\d+: item '2' is listed again"):
        MovieLensSource(MovieLensConfig(path=str(directory)))


@pytest.mark.parametrize("layout", ["grouplens", "recbole"])
def test_spaces_around_a_field_do_not_make_a_category_of_their_own(tmp_path, layout):
    """A gender "M " was a third gender beside "M" and "F"; an occupation " other" another."""
    write = write_grouplens if layout == "grouplens" else write_recbole
    plain = MovieLensSource(MovieLensConfig(path=str(write(tmp_path / "ml-plain"))))
    spaced = [(u, a, f"{g} ", f" {o}", z) for u, a, g, o, z in USERS]
    loose = MovieLensSource(MovieLensConfig(path=str(write(tmp_path / "ml-loose", users=spaced))))
    assert loose.vocabularies == plain.vocabularies and loose.vocabularies["gender"] == {"F": 1, "M": 2}
    for a, b in zip(batches(plain), batches(loose)):
        assert torch.equal(a.sparse.values, b.sparse.values) and torch.equal(a.dense, b.dense)


def test_a_recbole_file_that_is_not_utf8_keeps_its_tokens_apart(tmp_path):
    """Bytes that are not UTF-8 became U+FFFD, so two occupations "t\\xe9ch" and "t\\xe8ch" (Latin-1)
    were one; Latin-1's \\x85 (an ellipsis in cp1252 titles) must not end a line either."""
    users = [(u, a, g, {"technician": "t\xe9ch", "other": "t\xe8ch"}.get(o, o), z) for u, a, g, o, z in USERS]
    directory = write_recbole(tmp_path / "ml-latin")
    name = directory.name
    (directory / f"{name}.user").write_bytes((
        "user_id:token\tage:token\tgender:token\toccupation:token\tzip_code:token\n"
        + "".join("\t".join(u) + "\n" for u in users)).encode("latin-1"))
    item = (directory / f"{name}.item").read_bytes().replace(b"GoldenEye", b"Golden\x85Eye")
    (directory / f"{name}.item").write_bytes(item)
    source = MovieLensSource(MovieLensConfig(path=str(directory)))
    assert source.vocabularies["occupation"] == {"administrator": 1, "student": 2, "t\xe8ch": 3, "t\xe9ch": 4}
    assert len(source.vocabularies["item"]) == len(ITEMS)


def test_a_genre_index_that_is_not_a_number_names_its_file_and_line(tmp_path):
    """It was a bare "invalid literal for int() with base 10: 'two'"."""
    directory = write_grouplens(tmp_path / "ml-100k")
    (directory / "u.genre").write_text("unknown|0\nAction|1\nChildren's|two\nComedy|3\n")
    with pytest.raises(ValueError, match=r"u.genre:3: genre \"Children's\" has index 'two', expected a number"):
        MovieLensSource(MovieLensConfig(path=str(directory)))
