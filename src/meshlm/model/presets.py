"""Named model shapes, from a CPU-sized toy to the published Llama shapes.

The small presets train here; the large ones exist so that `meshlm memory` and `meshlm plan`
can account for real models. Shapes follow the published configs (ffn_dim included, since
Llama's SwiGLU hidden size is rounded, not exactly 8/3 * dim).
"""

from __future__ import annotations

PRESETS: dict[str, dict] = {
    # Trains on 2 CPU cores in a couple of minutes with the loss visibly falling.
    "tiny": dict(dim=192, n_layers=4, n_heads=6, n_kv_heads=2, ffn_dim=512, vocab_size=4096,
                 max_seq_len=1024, rope_theta=10000.0, tie_embeddings=True),
    # Small enough for fast multi-rank tests.
    "debug": dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=160, vocab_size=512,
                  max_seq_len=256, rope_theta=10000.0, tie_embeddings=False),
    # GPT-3 Small's width and depth with Llama blocks.
    "125m": dict(dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048, vocab_size=32000,
                 max_seq_len=2048, rope_theta=10000.0, tie_embeddings=True),
    # Llama-3.2-1B.
    "1b": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192, vocab_size=128256,
               max_seq_len=8192, rope_theta=500000.0, tie_embeddings=True),
    "llama2-7b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008, vocab_size=32000,
                      max_seq_len=4096, rope_theta=10000.0, tie_embeddings=False),
    "llama2-13b": dict(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824, vocab_size=32000,
                       max_seq_len=4096, rope_theta=10000.0, tie_embeddings=False),
    "llama2-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=32000,
                       max_seq_len=4096, rope_theta=10000.0, tie_embeddings=False),
    "llama3-8b": dict(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336, vocab_size=128256,
                      max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
    "llama3-70b": dict(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672, vocab_size=128256,
                       max_seq_len=8192, rope_theta=500000.0, tie_embeddings=False),
}
