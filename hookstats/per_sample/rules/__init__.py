"""The per-sample rules shipped with hookstats, one file per layer type (importing registers them)."""
from . import (batch_norm, conv, embedding, embedding_bag, group_norm, hf_conv1d, hf_embeddings,  # noqa: F401
               hf_linear, hf_moe_experts, hf_rms_norm, hf_swin_attention, hf_swinv2_attention, hf_vit_embeddings,
               layer_norm, linear, mixtral_router, peft_lora, refused, rms_norm, timm_conv2d_same, timm_layer_norm2d,
               timm_std_conv, timm_layer_scale, timm_swin_attention, timm_swinv2_attention, timm_vit_tokens)
