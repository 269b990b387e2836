"""Checkpoint pieces on their own: the rectangles of any flat range of a row-major tensor (every
range of small shapes, against the elements themselves), a shard's pieces placed in the full
tensor with the vocabulary padding dropped, and the shape check's three messages. Resharding
end to end is in test_checkpoint.py."""

from types import SimpleNamespace

import pytest
import torch

from meshlm.config import load_config, resolve
from meshlm.errors import ConfigError
from meshlm.train.checkpoint.pieces import Placement, Rect, as_2d, canonical_shapes, check_shapes, flat_range_rects, \
    segment_pieces


@pytest.mark.parametrize("cols", [1, 3, 5])
def test_every_flat_range_is_at_most_three_rectangles_holding_exactly_its_elements(cols):
    rows = 4
    full = torch.arange(rows * cols).view(rows, cols)
    for lo in range(rows * cols + 1):
        for hi in range(lo, rows * cols + 1):
            rects = flat_range_rects(cols, lo, hi)
            assert len(rects) <= 3 and all(r.rows > 0 and r.cols > 0 for r, _ in rects)
            got = torch.full((hi - lo,), -1)
            for rect, offset in rects:
                block = full[rect.row: rect.row + rect.rows, rect.col: rect.col + rect.cols]
                assert block.shape == (rect.rows, rect.cols)  # inside the tensor
                got[offset: offset + rect.numel] = block.reshape(-1)
            assert torch.equal(got, torch.arange(lo, hi)), (lo, hi)


def test_a_shards_pieces_sit_at_its_offset_and_leave_out_the_padding():
    # The last tp shard of a vocabulary of 10 rows padded to 12: local rows 6..11, rows 4, 5 padding.
    full = torch.arange(10 * 4, dtype=torch.float32).view(10, 4)
    local = torch.cat([full[6:], torch.full((2, 4), float("nan"))])
    placement = Placement("tok_embeddings.weight", (10, 4), (6, 4), (6, 0), True)
    for lo, hi in [(0, 24), (1, 23), (5, 18), (16, 24), (17, 19)]:  # ZeRO shards start and end mid-row
        data = local.reshape(-1)[lo:hi].clone()
        pieces = segment_pieces(placement, lo, hi)
        covered = 0
        for piece in pieces:
            r = piece.rect
            assert r.row >= 6 and r.row + r.rows <= 10 and r.rows > 0 and r.cols > 0  # no empty pieces either
            assert torch.equal(piece.view(data), full[r.row: r.row + r.rows, r.col: r.col + r.cols]), (lo, hi)
            covered += r.numel
        assert covered == sum(1 for i in range(lo, hi) if i < 16), (lo, hi)  # every real element, no padding
    # A column shard (tp on the input dimension) of a 1-D-viewed tensor: the offset moves columns.
    pieces = segment_pieces(Placement("w", (1, 8), (1, 4), (0, 4), True), 1, 3)
    assert [p.rect for p in pieces] == [Rect(0, 5, 1, 2)] and pieces[0].start == 0


def test_shapes_are_2d_views_and_a_3d_shape_is_refused():
    assert as_2d((7,)) == (1, 7) and as_2d((3, 5)) == (3, 5)
    with pytest.raises(ValueError, match=r"1-D and 2-D parameters, got shape \(2, 3, 4\)"):
        as_2d((2, 3, 4))


def test_the_shape_check_names_the_tensor_and_the_way_out():
    model = resolve(load_config(None, ["model.preset=debug", "model.n_layers=2", "model.tie_embeddings=true"]),
                    world_size=1).model
    shapes = canonical_shapes(model)
    assert shapes["tok_embeddings.weight"] == (model.vocab_size, model.dim) and "output.weight" not in shapes  # tied
    check_shapes(SimpleNamespace(path="ck", shapes=dict(shapes)), model)  # the same model: nothing to say
    missing = {k: v for k, v in shapes.items() if k != "layers.1.attention_norm.weight"}
    with pytest.raises(ConfigError, match=r"^ck: the checkpoint has no tensor layers\.1\.attention_norm\.weight"):
        check_shapes(SimpleNamespace(path="ck", shapes=missing), model)
    wrong = {**shapes, "norm.weight": (model.dim + 1,)}
    with pytest.raises(ConfigError, match=rf"^ck: tensor norm\.weight has shape \[{model.dim + 1}\], this model "
                                          rf"needs \[{model.dim}\]"):
        check_shapes(SimpleNamespace(path="ck", shapes=wrong), model)
    extra = {**shapes, "layers.2.ffn_norm.weight": (model.dim,), "layers.2.attention_norm.weight": (model.dim,)}
    with pytest.raises(ConfigError, match=r"^ck: tensor layers\.2\.attention_norm\.weight is not part of this model"):
        check_shapes(SimpleNamespace(path="ck", shapes=extra), model)
