"""HF `architectures` name -> flotilla model class."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from flotilla.models.deepseek_v3 import DeepseekV3ForCausalLM
from flotilla.models.deepseek_v4 import DeepseekV4ForCausalLM
from flotilla.models.llama import LlamaForCausalLM
from flotilla.models.qwen3 import Qwen3ForCausalLM
from flotilla.models.qwen3_5_moe import Qwen3_5MoeForCausalLM
from flotilla.models.qwen3_moe import Qwen3MoeForCausalLM
from flotilla.models.qwen3_vl import Qwen3VLForConditionalGeneration, Qwen3VLMoeForConditionalGeneration

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    # Kimi-K2's config.json names this architecture too (its own sizes; n_group = topk_group = 1).
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    # DeepSeek-V3.2 and GLM-5: DeepSeek-V3's model with sparse attention's indexer (config.json's index_topk)
    "DeepseekV32ForCausalLM": DeepseekV3ForCausalLM,
    "GlmMoeDsaForCausalLM": DeepseekV3ForCausalLM,
    "DeepseekV4ForCausalLM": DeepseekV4ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    # Mistral is Llama's graph; configs with a real sliding window are refused by the constructor.
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    # the released Qwen3.5 checkpoints: its language model (the vision tower is not loaded)
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeForConditionalGeneration,
}


def get_model_class(architectures: Sequence[str]) -> type[nn.Module]:
    """The class of the first supported name in a config's `architectures` list."""
    for arch in architectures:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(
        f"unsupported model architecture(s) {list(architectures)}; supported: {', '.join(sorted(MODEL_REGISTRY))}"
    )
