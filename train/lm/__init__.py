"""The decoder LM on the shared loop: model, corpora, data, trainer, generation."""
