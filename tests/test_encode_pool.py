"""The encoding pool's workers (data/encode.py) start without re-running the parent's main module:
under forkserver or spawn, multiprocessing imports the parent's `__main__` in every worker, and
meshlm's CLI imports torch (~1 s of CPU a worker; 16 workers took 16.8 s on 2 cores for a
0.4 MB corpus, 0.5 s without)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

MAIN = textwrap.dedent('''
    import os, sys
    with open(os.environ["MARKER"], "a") as f:  # once per process that runs this file
        f.write(f"{os.getpid()}\\n")

    if __name__ == "__main__":
        from meshlm.data.encode import EncodeSpec, EncoderPool, _init_worker, encode_chunk
        from meshlm.train.tokenizer import train_tokenizer

        texts = [f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 20 for i in range(8)]
        tokenizer = train_tokenizer(texts, 300)
        spec = EncodeSpec(tokenizer.to_str(), 0, "uint16", 300, 0.1, True)
        with EncoderPool(spec, 2) as pool:
            assert pool.pool is not None  # real worker processes, not the in-process fallback
            pooled = [chunk for _, chunk in pool.imap([(0, texts[:4]), (1, texts[4:])])]
        _init_worker(spec)
        alone = [encode_chunk(texts[:4]), encode_chunk(texts[4:])]
        for a, b in zip(pooled, alone):
            assert (a.train == b.train).all() and (a.val == b.val).all()
        print(sys.modules["__main__"].__file__)  # restored after the workers started
''')


def test_pool_workers_do_not_rerun_the_parents_main_module(tmp_path):
    script, marker = tmp_path / "main_script.py", tmp_path / "ran"
    script.write_text(MAIN)
    env = {**os.environ, "PYTHONPATH": str(SRC), "MARKER": str(marker)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(script)
    assert len(marker.read_text().split()) == 1  # the parent only; each worker used to run it too
