"""Save minillm's ``cpu-small`` shape twin (seed 0, the weights ``minillm serve --model cpu-small``
builds) as a Hugging Face checkpoint with the project's tokenizer, and, with ``--gguf``, as a GGUF
file for llama.cpp, so vLLM, llama-server and minillm serve the very same weights.

Not run by CI (it writes ~350 MB per format outside the repository). Run it with the repository's
Python; the GGUF writer needs the ``gguf`` package, which is kept out of the repository's venv:

    pip install --target /work/engines/pylib gguf
    PYTHONPATH=/work/engines/pylib .venv/bin/python scripts/engines/save_cpu_small_checkpoint.py \
        --out /work/engines/models/cpu-small-hf --gguf /work/engines/models/cpu-small-f32.gguf
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="cpu-small", help="a minillm preset (a shape twin)")
    ap.add_argument("--seed", type=int, default=0, help="the twin's seed (minillm serve uses 0)")
    ap.add_argument("--out", default="/work/engines/models/cpu-small-hf")
    ap.add_argument("--gguf", default=None, help="also write a GGUF file (F32) here")
    a = ap.parse_args()

    from minillm.bench.decode import to_transformers
    from minillm.engine.tokenizer import load_tokenizer
    from minillm.model.loader import load_model

    model = load_model(a.model, device="cpu", dtype="fp32", seed=a.seed)
    cfg = model.config
    tok = load_tokenizer(None)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    hf = to_transformers(model)
    # to_transformers leaves EOS/BOS unset (bench decodes with ignore_eos); a server wants them
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    hf.config.eos_token_id = eos
    hf.config.bos_token_id = cfg.bos_token_id
    hf.generation_config.eos_token_id = eos
    hf.generation_config.bos_token_id = cfg.bos_token_id
    hf.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    (out / "MINILLM_SOURCE.json").write_text(json.dumps(
        {"preset": a.model, "seed": a.seed, "dtype": "fp32", "what": "minillm shape twin (random weights)",
         "params": sum(p.numel() for p in hf.parameters())}, indent=1) + "\n")
    print(f"wrote {out} ({sum(p.numel() for p in hf.parameters()) / 1e6:.1f} M parameters)")

    if a.gguf:
        from minillm.bench.peers import write_gguf
        kind = write_gguf(model, a.gguf, tokenizer=tok)
        print(f"wrote {a.gguf} ({kind})")


if __name__ == "__main__":
    main()
