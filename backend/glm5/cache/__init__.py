"""Paged hybrid cache: MLA latent blocks, pooled index keys, kpool tails, KDA state slots."""
