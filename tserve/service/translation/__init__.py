"""Serving translators: the served model, its input rules, the translation memory, routing and pivots,
language detection, file formats and file jobs."""
