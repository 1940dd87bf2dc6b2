import pytest
import torch

from neorec.sparse import JaggedTensor, KeyedJaggedTensor, KeyedTensor


def make_kjt(weighted=False):
    # keys a, b; batch size 3; a: [1,2], [], [3]; b: [4], [5,6,7], []
    values = torch.tensor([1, 2, 3, 4, 5, 6, 7])
    lengths = torch.tensor([2, 0, 1, 1, 3, 0])
    weights = torch.arange(7, dtype=torch.float32) / 10 if weighted else None
    return KeyedJaggedTensor(["a", "b"], values, lengths, weights)


def test_offsets_and_split():
    kjt = make_kjt()
    assert kjt.batch_size == 3
    assert kjt.offsets().tolist() == [0, 2, 2, 3, 4, 7, 7]
    assert kjt.length_per_key() == [3, 4]
    assert kjt.offset_per_key() == [0, 3, 7]
    assert kjt["a"].to_list() == [[1, 2], [], [3]]
    assert kjt["b"].to_list() == [[4], [5, 6, 7], []]
    assert kjt["b"].offsets().tolist() == [0, 1, 4, 4]
    assert list(kjt.to_dict()) == ["a", "b"]
    assert kjt.lengths_2d().tolist() == [[2, 0, 1], [1, 3, 0]]


def test_permute_select_keep_weights():
    kjt = make_kjt(weighted=True)
    p = kjt.permute([1, 0])
    assert p.keys() == ["b", "a"]
    assert p["b"].to_list() == [[4], [5, 6, 7], []]
    assert p["a"].weights.tolist() == pytest.approx([0.0, 0.1, 0.2])
    assert p.values.tolist() == [4, 5, 6, 7, 1, 2, 3]
    s = kjt.select_keys(["b"])
    assert s.keys() == ["b"] and s.lengths.tolist() == [1, 3, 0]
    assert s.weights.tolist() == pytest.approx([0.3, 0.4, 0.5, 0.6])
    with pytest.raises(KeyError, match="no keys"):
        kjt.select_keys(["zz"])


def test_concat_and_from_dict_round_trip():
    kjt = make_kjt(weighted=True)
    a, b = kjt.select_keys(["a"]), kjt.select_keys(["b"])
    c = KeyedJaggedTensor.concat([a, b])
    assert torch.equal(c.values, kjt.values) and torch.equal(c.lengths, kjt.lengths)
    assert torch.equal(c.weights, kjt.weights)
    d = KeyedJaggedTensor.from_dict(kjt.to_dict())
    assert d.keys() == kjt.keys() and torch.equal(d.values, kjt.values)
    with pytest.raises(ValueError, match="more than once"):
        KeyedJaggedTensor.concat([a, a])
    with pytest.raises(ValueError, match="batch sizes differ"):
        KeyedJaggedTensor.concat([a, KeyedJaggedTensor(["x"], torch.tensor([1]), torch.tensor([1]))])


def test_to_device_keeps_everything():
    kjt = make_kjt(weighted=True).to("cpu")
    assert kjt.keys() == ["a", "b"] and kjt.batch_size == 3 and kjt.weights is not None


def test_validation_errors():
    with pytest.raises(ValueError, match="negative length -1 for key 'b', sample 1"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]), torch.tensor([1, 1, 2, -1]))
    with pytest.raises(ValueError, match="lengths sum to 3 but there are 2 values"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="not a multiple"):
        KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(ValueError, match="duplicate keys"):
        KeyedJaggedTensor(["a", "a"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="int32/int64"):
        KeyedJaggedTensor(["a"], torch.tensor([1.0]), torch.tensor([1]))
    with pytest.raises(ValueError, match="weights shape"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([2]), torch.ones(3))
    with pytest.raises(KeyError, match="no key 'c'"):
        make_kjt()["c"]


def test_empty_kjt():
    kjt = KeyedJaggedTensor.empty(batch_size=4)
    assert kjt.batch_size == 4 and len(kjt) == 0 and kjt.length_per_key() == []


def test_keyed_tensor():
    kt = KeyedTensor(["x", "y"], [2, 3], torch.arange(10.0).view(2, 5))
    assert kt["y"].tolist() == [[2.0, 3.0, 4.0], [7.0, 8.0, 9.0]]
    assert kt.offset_per_key() == [0, 2, 5]
    with pytest.raises(ValueError):
        KeyedTensor(["x"], [2], torch.zeros(2, 3))
    assert isinstance(JaggedTensor(torch.tensor([1]), torch.tensor([1])).offsets(), torch.Tensor)
    assert kt.blocks is None and kt.batch_size == 2


def test_keyed_tensor_from_column_blocks_copies_them_on_first_use():
    from neorec.sparse.column_blocks import ColumnBlocks

    # two parts of widths 2 and 3 ([2, 2] then [2, 3] in flat); output columns: y = part 1, x = part 0
    flat = torch.arange(10.0, requires_grad=True)
    blocks = ColumnBlocks(flat, 2, (2, 3), (), ((1, 0, 0, 3), (0, 0, 3, 2)))
    kt = KeyedTensor(["y", "x"], [3, 2], blocks)
    assert kt.blocks is blocks and kt.batch_size == 2
    assert kt["x"].tolist() == [[0.0, 1.0], [2.0, 3.0]] and kt["y"].tolist() == [[4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
    assert kt.values is kt.values  # built once
    (kt.values * torch.arange(1.0, 6.0)).sum().backward()
    assert flat.grad.tolist() == [4.0, 5.0, 4.0, 5.0, 1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="column blocks 5 wide"):
        KeyedTensor(["x"], [4], blocks)


def test_permute_and_select_keys_refuse_repeated_keys():
    kjt = make_kjt()
    with pytest.raises(ValueError, match=r"permute: order \[0, 0, 1\] repeats indices \[0\] \(keys \['a'\]\)"):
        kjt.permute([0, 0, 1])
    with pytest.raises(ValueError, match=r"select_keys: keys \['a'\] asked for more than once"):
        kjt.select_keys(["a", "a"])
    assert kjt.permute(iter([1])).keys() == ["b"]  # any iterable of indices
    # a tensor of indices: its 0-d elements hash by identity, so the repeat was not seen
    with pytest.raises(ValueError, match=r"permute: order \[0, 0\] repeats indices \[0\]"):
        kjt.permute(torch.tensor([0, 0]))
    assert kjt.permute(torch.tensor([1, 0])).keys() == ["b", "a"]
    with pytest.raises(TypeError, match=r"permute: order must hold integers, got \[0.5\]"):
        kjt.permute([0.5])


def test_from_dict_refuses_a_conflicting_batch_size():
    features = make_kjt().to_dict()
    assert KeyedJaggedTensor.from_dict(features, batch_size=3).batch_size == 3
    with pytest.raises(ValueError, match="batch_size=5 but the features have batch size 3"):
        KeyedJaggedTensor.from_dict(features, batch_size=5)
    assert KeyedJaggedTensor.from_dict({}, batch_size=5).batch_size == 5


def test_from_dict_checks_each_feature_on_its_own():
    """Joined, a feature's surplus ids passed as the next feature's: the totals agreed, so no error."""
    from neorec.sparse.jagged import JaggedTensor

    ids_moved = {"a": JaggedTensor(torch.tensor([10, 11, 12]), torch.tensor([1])),
                 "b": JaggedTensor(torch.zeros(0, dtype=torch.int64), torch.tensor([2]))}
    with pytest.raises(ValueError, match="feature 'a' has lengths summing to 1 but 3 values"):
        KeyedJaggedTensor.from_dict(ids_moved)
    weights_moved = {"a": JaggedTensor(torch.tensor([1, 2]), torch.tensor([1, 1]), weights=torch.tensor([0.5])),
                     "b": JaggedTensor(torch.tensor([3, 4]), torch.tensor([1, 1]), weights=torch.tensor([.1, .2, .3]))}
    with pytest.raises(ValueError, match="feature 'a' has 1 weights for 2 values"):
        KeyedJaggedTensor.from_dict(weights_moved)
    with pytest.raises(ValueError, match="feature 'a' needs 1-D values and lengths"):
        KeyedJaggedTensor.from_dict({"a": JaggedTensor(torch.tensor([[1]]), torch.tensor([1]))})


def test_select_keys_and_concat_refuse_what_is_not_a_list_of_keys_or_kjts():
    kjt = KeyedJaggedTensor(["a", "b", "ab"], torch.tensor([1, 2, 3]), torch.tensor([1, 1, 1]))
    with pytest.raises(TypeError, match="got the string 'ab'"):  # it selected the keys "a" and "b"
        kjt.select_keys("ab")
    assert kjt.select_keys(["ab"]).values.tolist() == [3]
    with pytest.raises(TypeError, match="a list of KeyedJaggedTensors, got one"):
        KeyedJaggedTensor.concat(kjt)
    with pytest.raises(TypeError, match=r"got \['Tensor'\] in it"):
        KeyedJaggedTensor.concat([kjt, torch.tensor([1])])
    assert KeyedJaggedTensor.concat(iter([kjt.select_keys(["a"]), kjt.select_keys(["b"])])).keys() == ["a", "b"]


def test_concat_empty_with_weighted():
    weighted = make_kjt(weighted=True)
    for parts in ([KeyedJaggedTensor.empty(3), weighted], [weighted, KeyedJaggedTensor.empty(3)]):
        c = KeyedJaggedTensor.concat(parts)
        c.validate()
        assert c.keys() == ["a", "b"] and torch.equal(c.weights, weighted.weights)
    # an unweighted input whose bags are all empty also fits
    no_ids = KeyedJaggedTensor(["z"], torch.zeros(0, dtype=torch.int64), torch.zeros(3, dtype=torch.int64))
    c = KeyedJaggedTensor.concat([no_ids, weighted])
    c.validate()
    assert c.keys() == ["z", "a", "b"] and torch.equal(c.weights, weighted.weights)
    # weighted inputs without values keep the result weighted; an unweighted one with values drops them
    assert KeyedJaggedTensor.concat([KeyedJaggedTensor.empty(3), weighted.select_keys([])]).weights is not None
    assert KeyedJaggedTensor.concat([weighted.select_keys([]), make_kjt()]).weights is None
    with pytest.raises(ValueError, match=r"some inputs have weights and some do not \(inputs \[0\] have weights, "
                                         r"inputs \[1\] have values"):
        KeyedJaggedTensor.concat([weighted.select_keys(["a"]), make_kjt().select_keys(["b"])])


def test_negative_batch_size_is_refused():
    with pytest.raises(ValueError, match="batch_size must be >= 0, got -1"):
        KeyedJaggedTensor([], torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), batch_size=-1)
    with pytest.raises(ValueError, match="batch_size must be >= 0, got -2"):
        KeyedJaggedTensor.empty(-2)


def test_keyed_tensor_refuses_negative_widths_and_repeated_keys():
    """[3, -1] over 2 columns passed (the widths add up): kt["x"] had 2 columns where 3 were said;
    a repeated key kept one of the two in to_dict()."""
    with pytest.raises(ValueError, match=r"KeyedTensor: widths must be >= 0, got \[3, -1\]"):
        KeyedTensor(["x", "y"], [3, -1], torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"KeyedTensor: duplicate keys \['x'\]"):
        KeyedTensor(["x", "x"], [1, 1], torch.zeros(2, 2))


def test_keyed_tensor_missing_key_is_a_key_error():
    kt = KeyedTensor(["x", "y"], [2, 3], torch.zeros(2, 5))
    with pytest.raises(KeyError, match=r"KeyedTensor has no key 'c'; keys are \['x', 'y'\]"):
        kt["c"]


def test_membership_iteration_and_input_types():
    """`"a" in kjt` raised KeyError('no key 0') (no __contains__ / __iter__ beside __getitem__);
    a string of keys, lists, a fractional batch size and tensors on two devices were taken."""
    kjt = KeyedJaggedTensor(["a", "b"], torch.tensor([1, 2]), torch.tensor([1, 1]))
    assert "a" in kjt and "z" not in kjt and list(kjt) == ["a", "b"]
    with pytest.raises(TypeError, match="keys must be a sequence of names, got the string 'ab'"):
        KeyedJaggedTensor("ab", torch.tensor([1, 2]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="values must be a torch.Tensor, got list"):
        KeyedJaggedTensor(["a"], [1], torch.tensor([1]))
    with pytest.raises(TypeError, match="batch_size must be an int, got 2.5"):
        KeyedJaggedTensor(["a"], torch.tensor([1, 2]), torch.tensor([1, 1]), batch_size=2.5)
    with pytest.raises(ValueError, match=r"must be on one device, got \['cpu', 'meta'\]"):
        KeyedJaggedTensor(["a"], torch.tensor([1], device="meta"), torch.tensor([1]))


def test_keys_must_be_feature_names():
    with pytest.raises(TypeError, match=r"keys must be feature names \(str\), got \[1, 2\]"):
        KeyedJaggedTensor([1, 2], torch.tensor([1, 2]), torch.tensor([1, 1]))
