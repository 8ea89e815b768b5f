"""Data: tokenizers, corpora, batches and routing records."""
