"""What the Hugging Face interop tests share (test_hf_interop.py: import and init_from;
test_hf_export.py: export and what generate loads): checkpoints saved under several layouts
with weights far from uniform, made once per session (conftest registers `saved`), and the
one-line-error helpers."""

import os
import subprocess
import sys

import torch

from meshlm.cli import main as meshlm_main
from meshlm.model import Llama, init_weights
from meshlm.testing import run_ranks
from meshlm.train.checkpoint import save_checkpoint

from helpers import build_trainer, small_cfg


SAVED = {  # layout -> (world size, overrides): sharded by dp (ZeRO-3), tp and pp, and one process
    "single-untied": (1, ["model.tie_embeddings=false"]),
    "single-tied": (1, ["model.tie_embeddings=true"]),
    "dp2-zero3": (2, ["model.tie_embeddings=false", "parallel.zero=3"]),
    "tp2": (2, ["model.tie_embeddings=false", "parallel.tp=2"]),
    "pp2-tied": (2, ["model.tie_embeddings=true", "parallel.pp=2"]),
    "cp2": (2, ["model.tie_embeddings=false", "parallel.cp=2"]),
}


class FullTensors:
    """A reader (as load_weights takes) over full tensors held in memory."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, kind, name, rect, out):
        full = self.tensors[name]
        full = full.view(1, -1) if full.ndim == 1 else full
        out.copy_(full[rect.row: rect.row + rect.rows, rect.col: rect.col + rect.cols])


def scaled_weights(model_cfg, seed: int = 3) -> dict[str, torch.Tensor]:
    """meshlm's initialisation x5 and norm weights in [0.5, 1.5]: logits far from uniform, so a
    wrong name, transpose or config field shows up in them (std 0.02 weights would hide it)."""
    model = Llama(model_cfg)
    init_weights(model, seed)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():  # a tied head is listed once, as the embedding
        out[name] = (torch.rand(p.shape, generator=gen) + 0.5) if name.endswith("norm.weight") else p.detach() * 5
    return out


def save_scaled(corpus, run_dir, world_size, extra):
    """Load the scaled weights into a trainer of this layout, train one step, save a checkpoint.
    Returns (full weights after the step, on rank 0; rank)."""
    trainer = build_trainer(small_cfg(corpus, run_dir, world_size, *extra, steps=2))
    from meshlm.train.checkpoint.state import load_weights

    load_weights(trainer, FullTensors(scaled_weights(trainer.cfg.model)), optimizer_state=False)
    trainer.train_step()
    full = {k: v.detach().clone() for k, v in trainer.full_state_dict().items()}
    save_checkpoint(trainer, run_dir / "checkpoints", keep=2)
    return full, trainer.ctx.rank


def saved_runs(corpus, tmp_path_factory):
    """layout -> (run dir, its checkpoint dir, full weights): made on first use (conftest's `saved`)."""
    made = {}

    def get(layout):
        if layout not in made:
            world, extra = SAVED[layout]
            run_dir = tmp_path_factory.mktemp(layout)
            args = (corpus, run_dir, world, extra)
            results = [save_scaled(*args)] if world == 1 else run_ranks(save_scaled, world, *args, timeout=120)
            made[layout] = (run_dir, run_dir / "checkpoints" / "step_0000001", results[0][0])
        return made[layout]

    return get


def small_args(corpus, run_dir):
    from helpers import small_train_args

    return [a for a in small_train_args(corpus, run_dir) if not a.startswith(("model.", "train.steps"))]


def meshlm_fails(*args: str, code: int) -> str:
    """`meshlm ARGS` in a subprocess; asserts exit `code` and one line on stderr, no traceback."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "meshlm.cli", *args], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), proc.stderr
    return lines[0]


def in_process_fails(capsys, *args: str, code: int) -> str:
    """The same through meshlm.cli.main in this process: cheaper for the many cases."""
    capsys.readouterr()
    assert meshlm_main(list(args)) == code
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshlm: error: "), lines
    return lines[0]
