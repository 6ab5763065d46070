"""Top-1 agreement of the fast path with the numpy reference on the 64-token fixture text, with llama.cpp's own agreement from its fixture for scale.

    python tests/tools/top1_vs_reference.py [--fixtures tests/fixtures]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine import registry  # noqa: E402
from engine.model import Model  # noqa: E402
from tests import reference as R  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fixtures", default=str(ROOT / "tests" / "fixtures"))
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    for name in ("smollm2-135m", "gemma3-270m"):
        fx = json.loads((Path(a.fixtures) / f"llamacpp_logits_{name}.json").read_text(encoding="utf-8"))
        ids = fx["ids"]
        path = registry.resolve(name)
        ref = R.load(path).forward(ids)
        ours = Model.load(path, threads=a.threads).forward_all(ids)
        want = ref.argmax(-1)
        print(f"{name}: top-1 vs the f32 reference over {len(ids)} positions: ours {int((ours.argmax(-1) == want).sum())}, "
              f"llama.cpp {int((np.asarray(fx['top1_ids']) == want).sum())} ({fx['llama_cpp_system_info'][:40]}...); "
              f"max |ours - reference| logit {float(np.abs(ours - ref).max()):.3f}")


if __name__ == "__main__":
    main()
