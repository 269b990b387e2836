"""`meshlm bench gpu [--presets 125m,1b] [--seq 2048] [--micro-batch 4] [--json]`: one GPU,
meshlm's training step against transformers' LlamaForCausalLM, eager and under torch.compile.
Reduces: guessing whether meshlm's single-GPU step (the base every layout multiplies) is as fast as
the library everyone fine-tunes with. Costs: a few minutes of one GPU (the 1b preset compiles).

meshlm: the trainer's own path: parallel/apply.py's build_local_model + build_engine on one rank
with train.dtype=bfloat16 (fp32 weights, bf16 autocast, the DDP engine's SegmentAdamW, fused on
CUDA; train.compile for the compiled rows: on one GPU the model's whole forward as one graph,
parallel/compile.py), stepped as Trainer.forward_backward and
optimizer_step do for one micro-batch: forward under autocast, summed token loss / tokens,
backward, clip to train.grad_clip, AdamW, zero the gradients.
reference: LlamaForCausalLM of the same shape and the same weights (sdpa attention), fp32 weights
under the same autocast, its own loss (labels=, num_items_in_batch=), clip_grad_norm_ and
torch.optim.AdamW(fused=True) with meshlm's decay groups; eager, then wrapped in torch.compile.
Each mode alternates its pair step by step (bench/timing.py); rows follow DESIGN.md's schema
(world_size 1) plus `mfu` (analysis/flops.py's model FLOPs over the device's dense bf16 peak),
`reference_mfu` and peak memory (CUDA allocator, one warm step each).
Issue targets, recorded per row (`targets_met`), never asserted: tokens/s ratio >= 1.0 against
transformers+compile, and MFU >= 45% for 1b at seq 2048.

Without a GPU it stops with one line (exit 2); `--device cpu` runs the same code on a tiny shape
(debug preset) as a smoke test of the path. Numbers from a CPU mean nothing about a GPU.
"""

from __future__ import annotations

import gc
import sys

import torch

from meshlm.bench.report import first_sentence, bench_row, emit, load_average, parse_args
from meshlm.bench.timing import alternate, measured_peak, random_batch
from meshlm.errors import OneLineErrorParser

TARGET_RATIO_VS_COMPILE = 1.0
TARGET_MFU = {("1b", 2048): 0.45}
CPU_SMOKE = dict(presets="debug", seq="64", micro_batch="2", steps=2, warmup=1)
GPU_DEFAULTS = dict(presets="125m,1b", seq="2048", micro_batch=None, steps=10, warmup=3)
# Without --micro-batch: the shapes. Both models stay resident side by side; the 1b pair at
# seq 2048 and micro-batch 4 peaked at 37.1 / 47.0 GB eager and 30.6 / 35.5 GB compiled on an 80 GB
# H100 (RESULTS.md, session 21). A mode that runs out of memory is reported in `failed` and the
# others still run.
MICRO_BATCH = {"125m": 8, "1b": 4}


def _autocast(device):
    return torch.autocast(device.type, dtype=torch.bfloat16)


class MeshlmEngine:
    """The trainer's model and step on one rank (see the module docstring)."""

    def __init__(self, cfg, ctx) -> None:
        from meshlm.comm import Comm
        from meshlm.parallel.apply import build_engine, build_local_model, build_loss

        self.comm = comm = Comm(ctx)
        self.device, self.train = ctx.device, cfg.train
        local = build_local_model(cfg, comm)
        self.loss_sum = build_loss(cfg, local.tp, comm)  # the trainer's: compiled chunks in the compile rows
        self.dp = build_engine(local, cfg, comm)
        self.first_loss = None  # the loss of the first step, from the initial weights

    def step(self, inputs, targets, tokens) -> None:
        with _autocast(self.device):
            logits = self.dp.module(inputs)
        loss = self.loss_sum(logits, targets)
        del logits
        (loss / tokens).backward()
        self.dp.finish_backward()
        self.dp.clip_and_step(self.train.lr, self.train.grad_clip)
        self.dp.zero_grad()
        if self.first_loss is None:
            self.first_loss = loss.item() / tokens

    def state(self):
        return [*self.dp.module.parameters(), *self.dp.state_tensors()]


class TransformersEngine:
    """LlamaForCausalLM with meshlm's weights, fused AdamW, optionally under torch.compile."""

    def __init__(self, meshlm: MeshlmEngine, compile_backend: str | None) -> None:
        from meshlm.bench.hf_twin import transformers_twin
        from meshlm.parallel.mixed_precision import decays

        t, device = meshlm.train, meshlm.device
        self.model = transformers_twin(meshlm.dp.module, device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if decays(p)], "weight_decay": t.weight_decay},
                  {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
        self.optimizer = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps,
                                           fused=device.type == "cuda" or None)
        self.forward = torch.compile(self.model, backend=compile_backend) if compile_backend else self.model
        self.device, self.clip, self.first_loss = device, t.grad_clip, None

    def step(self, inputs, targets, tokens) -> None:
        targets = targets.contiguous()  # the loss views them flat
        with _autocast(self.device):
            loss = self.forward(input_ids=inputs, labels=targets, shift_labels=targets,
                                num_items_in_batch=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.first_loss is None:
            self.first_loss = loss.item()

    def state(self):
        return [*self.model.parameters(), *(v for s in self.optimizer.state.values() for v in s.values())]


def transformers_loss_problem() -> str | None:
    """Why the reference's loss call would be wrong here, or None. It passes the targets, already
    shifted, as `shift_labels`; a transformers whose loss lacks that argument swallows it in
    **kwargs and shifts the labels again: no error, a model trained on the wrong tokens."""
    import inspect

    import transformers

    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # older than the loss module itself
        ForCausalLMLoss = None
    if ForCausalLMLoss is None or "shift_labels" not in inspect.signature(ForCausalLMLoss).parameters:
        return (f"transformers {transformers.__version__}: its causal-LM loss takes no shift_labels "
                "(the reference would train on shifted-twice targets); upgrade transformers")
    return None


def targets_met(row: dict) -> dict[str, bool]:
    """The issue's targets that apply to a row (recorded, not asserted)."""
    met = {}
    if row["reference"].endswith("compile"):
        met["tokens_per_s_ratio >= 1.0"] = row["tokens_per_s_ratio"] >= TARGET_RATIO_VS_COMPILE
    goal = TARGET_MFU.get((row["preset"], row["seq_len"]))
    if goal is not None and row["mfu"] is not None:
        met[f"mfu >= {goal:.2f}"] = row["mfu"] >= goal
    return met


def _mode_pair(preset: str, seq: int, mb: int, mode: str, opts, device):
    """(meshlm's, the reference's) per-step seconds, peaks and first-step losses for one mode."""
    from meshlm.config import load_config, resolve
    from meshlm.mesh import ParallelContext

    _release(device)
    compiled = mode == "compile"
    overrides = [f"model.preset={preset}", f"train.seq_len={seq}", f"train.micro_batch_size={mb}",
                 f"train.global_batch_size={mb}", "train.dtype=bfloat16",
                 f"parallel.backend={'nccl' if device.type == 'cuda' else 'gloo'}"]
    if compiled:  # train.compile: on one GPU meshlm's whole forward too (parallel/compile.py), as transformers
        overrides += ["train.compile=true", f"train.compile_backend={opts.compile_backend}"]
    cfg = resolve(load_config(None, overrides))
    ctx = ParallelContext.from_config(cfg.parallel)
    pair = {"meshlm": MeshlmEngine(cfg, ctx)}
    pair["reference"] = TransformersEngine(pair["meshlm"], opts.compile_backend if compiled else None)
    comm = pair["meshlm"].comm  # one rank: timing's barrier and gather are no-ops
    timed = alternate(pair, lambda i: random_batch(i, mb, seq, cfg.model.vocab_size, device), comm, device,
                      opts.warmup, opts.steps)
    times = {k: [t.step_s for t in v] for k, v in timed.items()}
    batch = random_batch(0, mb, seq, cfg.model.vocab_size, device)
    peaks = {k: measured_peak(e, batch, comm, device) for k, e in pair.items()}
    losses = {k: e.first_loss for k, e in pair.items()}
    n_params = sum(p.numel() for p in pair["meshlm"].dp.module.parameters())
    return cfg, n_params, times, peaks, losses


def _release(device) -> None:
    """Start a pair from a clean device: the last pair's engines freed (the DDP engine's hooks form
    reference cycles: only the collector frees them), and dynamo's caches dropped, so a compiled
    shape is compiled afresh for its own sizes (a second shape through the same code would otherwise
    be recompiled with dynamic sizes)."""
    gc.collect()
    torch._dynamo.reset()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _shape_rows(preset: str, seq: int, mb: int, opts, device, peak_tflops, failed: list[str]) -> list[dict]:
    """The rows of one shape, one per mode; a mode that fails (out of memory, a compiler error) is
    appended to `failed` and the others still run. Each row is announced on stderr as it lands, so
    a run cut short by a time limit still shows what it measured."""
    from meshlm.analysis.flops import flops_per_token, mfu

    rows, eager_meshlm = [], None
    for mode in opts.modes:
        try:
            cfg, n_params, times, peaks, losses = _mode_pair(preset, seq, mb, mode, opts, device)
        except Exception as e:  # noqa: BLE001 - reported in the output's `failed`, never silent
            failed.append(f"{preset} seq {seq} micro-batch {mb} {mode}: {type(e).__name__}: "
                          f"{(str(e).splitlines() or [''])[0][:300]}")
            print(f"meshlm bench gpu: {failed[-1]}" + ("; try a smaller --micro-batch"
                                                      if isinstance(e, torch.cuda.OutOfMemoryError) else ""),
                  file=sys.stderr, flush=True)
            _release(device)
            continue
        fpt = flops_per_token(cfg.model, seq)
        tokens = mb * seq
        m_tps, r_tps = [tokens / t for t in times["meshlm"]], [tokens / t for t in times["reference"]]
        row = bench_row(
            f"{preset}-s{seq}-b{mb}-{mode}", 1, "transformers" + ("+compile" if mode == "compile" else " eager"),
            m_tps, r_tps, peaks["meshlm"], peaks["reference"], preset=preset, seq_len=seq, micro_batch=mb,
            dtype="bfloat16", device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            compiled=mode == "compile", compile_backend=opts.compile_backend if mode == "compile" else None,
            parameters=n_params, flops_per_token=fpt,
            peak_tflops=peak_tflops, meshlm_loss=losses["meshlm"], reference_loss=losses["reference"])
        row["mfu"] = mfu(row["meshlm_tokens_per_s"], fpt, peak_tflops, 1)
        row["reference_mfu"] = mfu(row["reference_tokens_per_s"], fpt, peak_tflops, 1)
        if mode == "eager":
            eager_meshlm = row["meshlm_tokens_per_s"]
        elif eager_meshlm is not None:  # separate runs, not pairs: the medians' ratio
            row["meshlm_eager_vs_reference_ratio"] = eager_meshlm / row["reference_tokens_per_s"]
        row["targets_met"] = targets_met(row)
        rows.append(row)
        print(f"meshlm bench gpu: {row['name']}: {row['meshlm_tokens_per_s']:,.0f} vs {row['reference_tokens_per_s']:,.0f} "
              f"tokens/s ({row['reference']}), mfu {_pct(row['mfu'])}", file=sys.stderr, flush=True)
    return rows


def _list(text: str, kind, flag: str, p) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v]
    except ValueError:
        p.error(f"{flag}: expected a comma-separated list, got {text!r}")
    if not values:
        p.error(f"{flag}: empty")
    return values


def _parse(argv):
    p = OneLineErrorParser(prog="meshlm bench gpu", description=first_sentence(__doc__))
    p.add_argument("--presets", help=f"comma-separated model presets (default {GPU_DEFAULTS['presets']}; "
                                     f"--device cpu: {CPU_SMOKE['presets']})")
    p.add_argument("--seq", help=f"comma-separated sequence lengths (default {GPU_DEFAULTS['seq']})")
    p.add_argument("--micro-batch", help=f"comma-separated micro-batch sizes (default per preset: {MICRO_BATCH}, "
                                         f"else 4)")
    p.add_argument("--steps", type=int, help="timed pairs per row (default 10)")
    p.add_argument("--warmup", type=int, help="untimed pairs first (default 3; compilation happens here)")
    p.add_argument("--modes", default="eager,compile", help="comma-separated: eager, compile")
    p.add_argument("--compile-backend", default="inductor", help="torch.compile backend for both sides")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a smoke run of the same path on a tiny shape (no GPU needed)")
    p.add_argument("--peak-tflops", type=float, help="peak dense TFLOP/s for MFU (default: the GPU's, from "
                                                     "analysis/flops.py; none on a CPU)")
    p.add_argument("--json", action="store_true")
    opts = p.parse_args(argv)
    defaults = CPU_SMOKE if opts.device == "cpu" else GPU_DEFAULTS
    for key, value in defaults.items():
        if getattr(opts, key) is None:
            setattr(opts, key, value)
    opts.presets = _list(opts.presets, str, "--presets", p)
    opts.seq = _list(opts.seq, int, "--seq", p)
    opts.micro_batch = _list(opts.micro_batch, int, "--micro-batch", p) if opts.micro_batch else None
    opts.modes = _list(opts.modes, str, "--modes", p)
    if set(opts.modes) - {"eager", "compile"}:
        p.error(f"--modes: eager and/or compile, got {','.join(opts.modes)}")
    if min(opts.seq + (opts.micro_batch or []) + [opts.steps, opts.warmup + 1]) < 1:
        p.error("--seq, --micro-batch and --steps must be >= 1, --warmup >= 0")
    return opts


def main(argv: list[str] | None = None) -> int:
    opts, code = parse_args(_parse, argv)
    if opts is None:
        return code
    if opts.device == "cuda" and not torch.cuda.is_available():
        print("meshlm bench gpu: no CUDA GPU here (torch.cuda.is_available() is False); "
              "--device cpu runs the same path on a tiny shape as a smoke test", file=sys.stderr)
        return 2
    from meshlm.analysis.flops import device_peak_tflops
    from meshlm.config import ConfigError, load_config, resolve

    device = torch.device("cuda", torch.cuda.current_device()) if opts.device == "cuda" else torch.device("cpu")
    for preset in opts.presets:  # bad shapes are usage errors: one line before anything runs
        for seq in opts.seq:
            try:
                resolve(load_config(None, [f"model.preset={preset}", f"train.seq_len={seq}"]))
            except ConfigError as e:
                print(f"meshlm bench gpu: error: {e}", file=sys.stderr)
                return 2
    problem = transformers_loss_problem()
    if problem:
        print(f"meshlm bench gpu: error: {problem}", file=sys.stderr)
        return 2
    peak = opts.peak_tflops or device_peak_tflops(device, "bfloat16")
    rows, failed = [], []
    for preset in opts.presets:
        for seq in opts.seq:
            for mb in opts.micro_batch or [MICRO_BATCH.get(preset, 4)]:
                rows += _shape_rows(preset, seq, mb, opts, device, peak, failed)
    if not rows:
        return 1
    emit(rows, opts.json, bench="gpu", device=rows[0]["device"], peak_tflops=peak, failed=failed or None,
         targets=[f"tokens_per_s_ratio >= {TARGET_RATIO_VS_COMPILE} vs transformers+compile",
                  "mfu >= 0.45 for 1b at seq 2048"], load_average=load_average())
    if not opts.json:
        for r in rows:
            print(f"{r['name']}: mfu {_pct(r['mfu'])} (reference {_pct(r['reference_mfu'])}), "
                  f"first-step loss {r['meshlm_loss']:.4f} vs {r['reference_loss']:.4f}"
                  + "".join(f", {k}: {'met' if v else 'MISSED'}" for k, v in r["targets_met"].items()))
    return 0


def _pct(v) -> str:
    return "n/a" if v is None else f"{100 * v:.1f}%"


if __name__ == "__main__":
    raise SystemExit(main())
