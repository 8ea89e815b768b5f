"""config.json files exactly as transformers 4.57.6 writes them (`Config(**args).save_pretrained`,
`transformers_version` left out) for the tiny models of tests/hf_models.py, with the rotary given in
4.x's spelling: `rope_theta` (Mixtral's 1e4, not its 1e6 default, so that a lost theta shows) and, for
YaRN, DeepSeek's own `rope_scaling` (`type: yarn`). transformers 4.x is not installed beside the suite
(which runs 5.x), so the files are kept here; regenerate them with a 4.57 install from the arguments
of hf_models.py's builders.

KEYS_4X: the keys 4.57's config classes take (their `__init__` arguments) that shape the model it
builds, written by hand from those classes, plus those its modeling code reads beside them
(Qwen3-MoE's `head_dim` through getattr; Mixtral's rotary reads `rope_scaling` when it is set).
"""

KEYS_4X = {
    "qwen3_moe": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                  "tie_word_embeddings", "rope_theta", "rope_scaling", "attention_bias", "use_sliding_window",
                  "decoder_sparse_step", "moe_intermediate_size", "num_experts_per_tok", "num_experts",
                  "norm_topk_prob", "router_aux_loss_coef", "mlp_only_layers"),
    "mixtral": ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "rope_theta", "rope_scaling", "sliding_window", "num_experts_per_tok",
                "num_local_experts", "router_aux_loss_coef", "router_jitter_noise"),
    "deepseek_v3": ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "n_shared_experts", "n_routed_experts",
                    "routed_scaling_factor", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim",
                    "qk_nope_head_dim", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace",
                    "norm_topk_prob", "hidden_act", "max_position_embeddings", "rms_norm_eps",
                    "tie_word_embeddings", "rope_theta", "rope_scaling", "rope_interleave", "attention_bias"),
}

QWEN3_MOE = {'attention_bias': False, 'attention_dropout': 0.0, 'decoder_sparse_step': 1, 'head_dim': 12,
             'hidden_act': 'silu', 'hidden_size': 32, 'initializer_range': 0.02, 'intermediate_size': 48,
             'max_position_embeddings': 64, 'mlp_only_layers': [0], 'model_type': 'qwen3_moe',
             'moe_intermediate_size': 24, 'norm_topk_prob': True, 'num_attention_heads': 4, 'num_experts': 5,
             'num_experts_per_tok': 2, 'num_hidden_layers': 3, 'num_key_value_heads': 2,
             'output_router_logits': False, 'rms_norm_eps': 1e-05, 'rope_scaling': None, 'rope_theta': 5000.0,
             'router_aux_loss_coef': 0.01, 'sliding_window': None, 'tie_word_embeddings': False,
             'use_cache': True, 'use_sliding_window': False, 'vocab_size': 320}
MIXTRAL = {'attention_dropout': 0.0, 'bos_token_id': 1, 'eos_token_id': 2, 'head_dim': None,
           'hidden_act': 'silu', 'hidden_size': 32, 'initializer_range': 0.02, 'intermediate_size': 24,
           'max_position_embeddings': 64, 'model_type': 'mixtral', 'num_attention_heads': 4,
           'num_experts_per_tok': 2, 'num_hidden_layers': 2, 'num_key_value_heads': 2, 'num_local_experts': 4,
           'output_router_logits': False, 'rms_norm_eps': 1e-05, 'rope_theta': 10000.0,
           'router_aux_loss_coef': 0.02, 'router_jitter_noise': 0.0, 'sliding_window': None,
           'tie_word_embeddings': False, 'use_cache': True, 'vocab_size': 320}
DEEPSEEK_V3 = {'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 0, 'eos_token_id': 1,
               'first_k_dense_replace': 1, 'head_dim': 4, 'hidden_act': 'silu', 'hidden_size': 32,
               'initializer_range': 0.02, 'intermediate_size': 48, 'kv_lora_rank': 12,
               'max_position_embeddings': 64, 'model_type': 'deepseek_v3', 'moe_intermediate_size': 12,
               'n_group': 4, 'n_routed_experts': 8, 'n_shared_experts': 2, 'norm_topk_prob': True,
               'num_attention_heads': 4, 'num_experts_per_tok': 3, 'num_hidden_layers': 3,
               'num_key_value_heads': 4, 'pretraining_tp': 1, 'q_lora_rank': 16, 'qk_head_dim': 10,
               'qk_nope_head_dim': 6, 'qk_rope_head_dim': 4, 'rms_norm_eps': 1e-05, 'rope_interleave': True,
               'rope_scaling': None, 'rope_theta': 5000.0, 'routed_scaling_factor': 2.5,
               'tie_word_embeddings': False, 'topk_group': 2, 'use_cache': True, 'v_head_dim': 5,
               'vocab_size': 320}
DEEPSEEK_V3_YARN = {'attention_bias': False, 'attention_dropout': 0.0, 'bos_token_id': 0, 'eos_token_id': 1,
                    'first_k_dense_replace': 1, 'head_dim': 8, 'hidden_act': 'silu', 'hidden_size': 32,
                    'initializer_range': 0.02, 'intermediate_size': 48, 'kv_lora_rank': 12,
                    'max_position_embeddings': 64, 'model_type': 'deepseek_v3', 'moe_intermediate_size': 12,
                    'n_group': 4, 'n_routed_experts': 8, 'n_shared_experts': 2, 'norm_topk_prob': True,
                    'num_attention_heads': 4, 'num_experts_per_tok': 3, 'num_hidden_layers': 3,
                    'num_key_value_heads': 4, 'pretraining_tp': 1, 'q_lora_rank': 16, 'qk_head_dim': 14,
                    'qk_nope_head_dim': 6, 'qk_rope_head_dim': 8, 'rms_norm_eps': 1e-05,
                    'rope_interleave': True,
                    'rope_scaling': {'beta_fast': 32.0, 'beta_slow': 1.0, 'factor': 2.0, 'mscale': 1.0,
                                     'mscale_all_dim': 0.8, 'original_max_position_embeddings': 32,
                                     'rope_type': 'yarn', 'type': 'yarn'},
                    'rope_theta': 500.0, 'routed_scaling_factor': 2.5, 'tie_word_embeddings': False,
                    'topk_group': 2, 'use_cache': True, 'v_head_dim': 5, 'vocab_size': 320}

CONFIGS_4X = {"qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL, "deepseek_v3": DEEPSEEK_V3,
              "deepseek_v3_yarn": DEEPSEEK_V3_YARN}
