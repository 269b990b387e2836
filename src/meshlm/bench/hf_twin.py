"""transformers' LlamaForCausalLM with a meshlm Llama's weights: the reference model some benches
run PyTorch's engines on (bench gpu always; bench dp and bench scaling with
`--reference-model transformers`), so a comparison can be engine against engine or stack against
stack. Reduces: a hand-copied second model per bench. Costs: importing transformers (seconds)."""

from __future__ import annotations

import torch


def transformers_twin(model, device) -> torch.nn.Module:
    """A LlamaForCausalLM of `model`'s shape (meshlm's Llama) holding the same weights, in train
    mode, sdpa attention (flash / memory-efficient kernels on CUDA), no KV cache."""
    import transformers

    from meshlm.train.checkpoint.hf import hf_name
    from meshlm.train.checkpoint.hf_export import llama_config

    config = transformers.LlamaConfig(**{**llama_config(model.cfg, None), "use_cache": False},
                                      attn_implementation="sdpa")
    with torch.device(device):
        twin = transformers.LlamaForCausalLM(config)
    missing, unexpected = twin.load_state_dict({hf_name(n): p.detach() for n, p in model.named_parameters()},
                                               strict=False)
    if unexpected or set(missing) - {"lm_head.weight"}:  # a tied head is the embedding, listed once
        raise RuntimeError(f"transformers twin: missing {missing}, unexpected {unexpected}")
    return twin.train()
