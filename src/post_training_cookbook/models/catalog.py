"""The model catalog: which models the cookbook knows, and what each can do.

A model id is a catalog id (``list_models()``) or the path of a local Hugging Face folder
(``config.json``, weights, a tokenizer with a chat template). Everything here is decided
from metadata alone, so a bad model choice fails before any weights load.

Generator support vs trainer-only: GRPO samples while it trains, so it needs a model whose
chat template renders tools and whose tool calls a codec can parse. A trainer-only model can
still be fine-tuned with ``post_training_cookbook.sft``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from post_training_cookbook.files import BadFileError, check_safetensors, read_json_object
from post_training_cookbook.lazy import module_getattr
from post_training_cookbook.models.bundled import BUNDLED_MODEL_DIR, BUNDLED_MODEL_ID

TRAINING_MODES = ("lora", "full")
ENGINES = ("torch", "vllm")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    source: str
    """A local folder, or a Hugging Face hub id (needs access to the hub or its cache)."""
    codec: str | None
    """Codec name (see ``post_training_cookbook.codecs``); None = inferred from the template."""
    generator_support: bool
    max_context: int
    """Longest prompt + completion one episode may hold."""
    training_modes: tuple[str, ...] = TRAINING_MODES
    default_dtype: str = "bfloat16"
    codec_options: dict[str, Any] = field(default_factory=dict)
    trainer_only_reason: str = ""
    description: str = ""
    engines: tuple[str, ...] = ENGINES
    """The generation engines that can sample it (``GRPOConfig.generation_engine``), the one
    ``"auto"`` prefers first (``default_engine``)."""
    linear_attention: bool = False
    """A hybrid: Gated DeltaNet linear-attention layers beside full attention (Qwen3.5 and
    later). Both engines sample it; ``"auto"`` takes vLLM on a GPU and the torch engine on a
    CPU, where vLLM's build is optional."""

    @property
    def trainer_only(self) -> bool:
        return not self.generator_support

    @property
    def is_local(self) -> bool:
        return Path(self.source).is_dir()


_QWEN3_NOTE = "Qwen3: thinking on by default (codec option enable_thinking)"
_HYBRID = "; hybrid Gated DeltaNet attention: vLLM on a GPU, the torch engine on a CPU"
HYBRID_ENGINES = ("vllm", "torch")
"""A hybrid model's engines: vLLM first, the default on a GPU (``default_engine``)."""
_LLAMA_NOTE = "gated on the hub: accept Meta's license, then set HF_TOKEN"
CATALOG: dict[str, ModelInfo] = {
    info.model_id: info
    for info in [
        ModelInfo(
            model_id=BUNDLED_MODEL_ID,
            source=str(BUNDLED_MODEL_DIR),
            codec="hermes",
            codec_options={"default_system": None},
            generator_support=True,
            max_context=2048,
            default_dtype="float32",
            description="4.5M-parameter Llama tool-use model shipped in the package (no download)",
        ),
        ModelInfo("Qwen/Qwen2.5-0.5B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct", "hermes",
                  True, 32768, description="Qwen2.5 instruct, Hermes tool calls"),
        ModelInfo("Qwen/Qwen2.5-1.5B-Instruct", "Qwen/Qwen2.5-1.5B-Instruct", "hermes",
                  True, 32768, description="Qwen2.5 instruct, Hermes tool calls"),
        ModelInfo("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct", "hermes",
                  True, 32768, description="Qwen2.5 instruct, Hermes tool calls"),
        ModelInfo("Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", "qwen3", True, 40960,
                  description=_QWEN3_NOTE),
        ModelInfo("Qwen/Qwen3-1.7B", "Qwen/Qwen3-1.7B", "qwen3", True, 40960,
                  description=_QWEN3_NOTE),
        ModelInfo("Qwen/Qwen3-4B", "Qwen/Qwen3-4B", "qwen3", True, 40960,
                  description=_QWEN3_NOTE),
        ModelInfo("Qwen/Qwen3-8B", "Qwen/Qwen3-8B", "qwen3", True, 40960,
                  description=_QWEN3_NOTE),
        ModelInfo("Qwen/Qwen3-4B-Instruct-2507", "Qwen/Qwen3-4B-Instruct-2507", "qwen3-2507",
                  True, 262144, description="Qwen3 instruct 2507: no thinking, Hermes tool calls"),
        ModelInfo("Qwen/Qwen3.6-35B-A3B", "Qwen/Qwen3.6-35B-A3B", "qwen3.6", True, 262144,
                  engines=HYBRID_ENGINES, linear_attention=True,
                  description="Qwen3.6 mixture of experts (3B active), XML tool calls; codec "
                  "options enable_thinking, preserve_thinking" + _HYBRID),
        ModelInfo("Qwen/Qwen3.8-27B", "Qwen/Qwen3.8-27B", "qwen3.8", True, 262144,
                  engines=HYBRID_ENGINES, linear_attention=True,
                  description="Qwen3.8 dense, XML tool calls; codec options enable_thinking, "
                  "preserve_thinking (on), reasoning_effort" + _HYBRID),
        ModelInfo("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B-Instruct",
                  "llama3.1", True, 131072,
                  description="Llama 3.1 instruct, one JSON tool call per turn; " + _LLAMA_NOTE),
        ModelInfo("meta-llama/Llama-3.2-3B-Instruct", "meta-llama/Llama-3.2-3B-Instruct",
                  "llama3.2", True, 131072,
                  description="Llama 3.2 instruct, one JSON tool call per turn; " + _LLAMA_NOTE),
        ModelInfo(
            "HuggingFaceTB/SmolLM2-135M-Instruct", "HuggingFaceTB/SmolLM2-135M-Instruct",
            None, False, 8192,
            trainer_only_reason="its chat template drops tools and it emits no tool calls",
            description="SmolLM2 instruct; SFT only",
        ),
    ]
}  # fmt: skip


def list_models() -> list[ModelInfo]:
    """Every catalog entry, the bundled model first."""
    return list(CATALOG.values())


def resolve_model(model: str, *, codec: str | None = None) -> ModelInfo:
    """The catalog entry for ``model``, or an entry describing a local Hugging Face folder.

    A local folder has generator support when a codec is named or can be inferred from its
    tokenizer's chat template (``<tool_call>`` → hermes, ``<think>`` → qwen3). Its JSON files
    and its safetensors weights (headers and lengths, not the tensors) are checked here, so a
    damaged folder fails with a ``ValueError`` naming the file before anything loads.
    """
    if model in CATALOG:
        info = CATALOG[model]
        if codec is not None and codec != info.codec:
            info = _with(info, codec=codec, generator_support=True, trainer_only_reason="")
        return info
    folder = Path(model).expanduser()
    if not (folder / "config.json").is_file():
        known = ", ".join(CATALOG)
        raise ValueError(
            f"unknown model {model!r}: not a catalog id ({known}) "
            "and not a local folder with a config.json"
        )
    return _local_model_info(folder, codec)


def require_engine_support(info: ModelInfo, engine: str) -> None:
    """Raise a ``ValueError`` naming the model when ``engine`` cannot sample it."""
    if engine not in info.engines:
        raise ValueError(
            f"model {info.model_id!r} cannot sample with generation_engine={engine!r}; "
            f"use one of {list(info.engines)}"
        )


def default_engine(
    info: ModelInfo, on_gpu: bool, router_replay: bool = False
) -> Literal["torch", "vllm"]:
    """The engine ``generation_engine="auto"`` picks for ``info``: its first engine, except
    that the torch engine is taken where it is listed by generators without a GPU (vLLM's CPU
    build is an optional install, docs/scale_out.md) and by runs with router replay on (only
    the torch engine records the experts each token went to)."""
    prefer_torch = not on_gpu or router_replay
    if info.engines[0] == "torch" or (prefer_torch and "torch" in info.engines):
        return "torch"
    return "vllm"


def require_generator_support(info: ModelInfo) -> None:
    """Raise a ``ValueError`` naming the model when it cannot sample (GRPO needs that)."""
    if info.generator_support:
        return
    usable = ", ".join(i.model_id for i in list_models() if i.generator_support)
    raise ValueError(
        f"model {info.model_id!r} is trainer-only ({info.trainer_only_reason}); GRPO samples "
        f"while training and needs a model with generator support, such as: {usable}"
    )


def check_model_can_sample(info: ModelInfo, max_model_length: int) -> None:
    """GRPO and evaluation sample episodes of up to ``max_model_length`` tokens: raise a
    ``ValueError`` unless the model has generator support and that much context."""
    require_generator_support(info)
    if max_model_length > info.max_context:
        raise ValueError(
            f"max_model_length={max_model_length} exceeds {info.model_id}'s context of "
            f"{info.max_context} tokens"
        )


# Read by the tokenizer and from_pretrained, whose errors would not name them.
_OTHER_JSON_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "generation_config.json",
)


_COUNT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
)
"""config.json fields that must be counts: transformers' own error for one of another type
is a traceback naming no file."""


def _local_model_info(folder: Path, codec: str | None) -> ModelInfo:
    config = read_json_object(folder / "config.json")
    for name in _COUNT_FIELDS:
        value = config.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise BadFileError(folder / "config.json", f"{name} is {value!r:.40}, not a count")
    for name in _OTHER_JSON_FILES:
        if (folder / name).exists():
            read_json_object(folder / name)
    _check_weights(folder)
    template = _chat_template_text(folder)
    from post_training_cookbook.codecs.inference import infer_codec_name

    inferred = codec or infer_codec_name(template)
    reason = (
        ""
        if inferred
        else (
            "no codec given and none inferred from its chat template; "
            "codec='template' drives any template that renders tools"
        )
    )
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    hybrid = _has_linear_attention(config)
    context = config.get("max_position_embeddings", 2048)
    if not isinstance(context, int) or isinstance(context, bool) or context < 1:
        raise BadFileError(
            folder / "config.json", f"max_position_embeddings is {context!r}, not a count"
        )
    return ModelInfo(
        model_id=str(folder),
        source=str(folder),
        codec=inferred,
        generator_support=inferred is not None,
        max_context=context,
        default_dtype=dtype,
        trainer_only_reason=reason,
        description=f"local {config.get('model_type', 'causal LM')} folder",
        engines=HYBRID_ENGINES if hybrid else ENGINES,
        linear_attention=hybrid,
    )


def _has_linear_attention(config: dict[str, Any]) -> bool:
    """Whether config.json lists linear-attention layers (a multimodal Qwen3.5 keeps them
    in its ``text_config``)."""
    text = config.get("text_config")
    kinds = config.get("layer_types") or (text.get("layer_types") if isinstance(text, dict) else [])
    return isinstance(kinds, list) and "linear_attention" in kinds


def _check_weights(folder: Path) -> None:
    """The safetensors weights, one file or the shards an index names, describe their bytes
    exactly. Other formats (``pytorch_model.bin``) are left to ``from_pretrained``."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise BadFileError(index, "has no weight_map naming the shards")
        for shard in sorted(set(map(str, weight_map.values()))):
            check_safetensors(folder / shard)
    elif (folder / "model.safetensors").exists():
        check_safetensors(folder / "model.safetensors")


def _chat_template_text(folder: Path) -> str:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    tokenizer_config = folder / "tokenizer_config.json"
    if tokenizer_config.is_file():
        template = read_json_object(tokenizer_config).get("chat_template", "")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            return " ".join(str(_entry(entry).get("template", "")) for entry in template)
        return str(template or "")
    return ""


def _entry(entry: Any) -> dict[str, Any]:
    return entry if isinstance(entry, dict) else {}


def check_codec_options(info: ModelInfo, options: Mapping[str, object]) -> dict[str, object]:
    """``info``'s codec options with ``options`` (a run's choices) on top, checked.

    Raises a ``ValueError`` naming the model and codec for an option its codec does not have
    (``reasoning_effort`` on Qwen3.6) or a value it does not take, before anything loads.
    ``None`` values mean "the codec's default" and are dropped.
    """
    chosen = {name: value for name, value in options.items() if value is not None}
    if not chosen:
        return dict(info.codec_options)
    if info.codec is None:
        raise ValueError(
            f"model {info.model_id!r} has no codec ({info.trainer_only_reason}), so codec "
            f"options {sorted(chosen)} cannot apply; name a codec first"
        )
    from post_training_cookbook.codecs import CODECS

    codec_class = CODECS.get(str(info.codec))
    if codec_class is None:
        raise ValueError(f"model {info.model_id!r}: unknown codec {info.codec!r}")
    allowed = dict(codec_class.options)
    if info.codec == "template":
        allowed = _template_options(info)
    if "control_tokens_in_content" in chosen:  # every codec has it (the Codec base's own)
        allowed = {**allowed, "control_tokens_in_content": (False, True)}
    for name, value in chosen.items():
        if name not in allowed:
            has = ", ".join(sorted(allowed)) or "none"
            raise ValueError(
                f"model {info.model_id!r} (codec {info.codec!r}) has no codec option {name!r}; "
                f"its options: {has}"
            )
        if value not in allowed[name] or type(value) is not type(allowed[name][0]):
            raise ValueError(
                f"model {info.model_id!r} (codec {info.codec!r}): {name}={value!r} is not one "
                f"of {list(allowed[name])}"
            )
    return {**info.codec_options, **chosen}


TEMPLATE_OPTIONS: dict[str, tuple[object, ...]] = {
    "enable_thinking": (True, False),
    "preserve_thinking": (True, False),
    "reasoning_effort": ("xhigh", "high", "medium", "low", "minimal", "none"),
}
"""What codec ``template`` passes to the chat template, where the template reads it."""


def _template_options(info: ModelInfo) -> dict[str, tuple[object, ...]]:
    template = _chat_template_text(Path(info.source)) if info.is_local else ""
    if not template:  # a hub id: the template is unknown until the tokenizer loads
        return TEMPLATE_OPTIONS
    return {name: values for name, values in TEMPLATE_OPTIONS.items() if name in template}


def _with(info: ModelInfo, **changes: Any) -> ModelInfo:
    from dataclasses import replace

    return replace(info, **changes)


# moved to the codecs, which own their formats
__getattr__ = module_getattr(
    __name__, moved={"infer_codec_name": "post_training_cookbook.codecs.inference"}
)
