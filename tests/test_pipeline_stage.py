"""Pipeline stages on their own (parallel/pipeline/stage.py): how the layers are split. The
stages' numbers against one process are test_pipeline.py's."""

import pytest

from meshlm.parallel.pipeline.stage import split_layers


@pytest.mark.parametrize("n_stages", range(1, 9))
def test_a_balanced_split_covers_every_layer_once_first_stages_taking_the_remainder(n_stages):
    """Contiguous runs in order, sizes differing by at most one, the larger ones first (the last
    stage also carries the head and the loss): checked against those properties, not a formula."""
    for n_layers in range(0, 3 * n_stages + 2):
        ranges = split_layers(n_layers, n_stages)
        assert len(ranges) == n_stages
        assert [i for r in ranges for i in r] == list(range(n_layers))  # each layer once, in order
        counts = [len(r) for r in ranges]
        assert max(counts) - min(counts) <= 1, (n_layers, counts)
        assert counts == sorted(counts, reverse=True), (n_layers, counts)


def test_an_explicit_split_is_taken_as_given_and_bad_ones_are_named():
    assert split_layers(5, 3, [2, 0, 3]) == [range(0, 2), range(2, 2), range(2, 5)]
    assert split_layers(4, 2, (0, 4)) == [range(0, 0), range(0, 4)]
    for bad in ([2, 3], [2, 2, 1, 0], [3, -1, 3], [1, 1, 1], [6, 0, 0]):  # how many, a negative, the sum
        with pytest.raises(ValueError, match=rf"layers_per_stage=\[.*\]: need 3 counts >= 0 summing to n_layers=5"):
            split_layers(5, 3, bad)
