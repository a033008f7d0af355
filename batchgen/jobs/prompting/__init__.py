"""Prompt construction: a row's text (template, chat template, special tokens) to the token ids it runs."""
