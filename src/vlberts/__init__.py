"""vlberts: vision-and-language BERTs on shared exact-BERT building blocks."""

__version__ = "0.1.0"
