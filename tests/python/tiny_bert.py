"""A tiny BERT configuration for the tests that train Hugging Face models (nothing downloaded)."""

import transformers


def tiny_bert_config(**changes) -> transformers.BertConfig:
    """Dropout off (ORT draws its own random numbers: docs/training.md); `changes` replace or add
    settings."""
    settings = dict(
        vocab_size=99,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        type_vocab_size=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return transformers.BertConfig(**{**settings, **changes})
