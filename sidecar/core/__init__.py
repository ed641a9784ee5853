"""The base: what every layer above may use (errors, ids, files, logs, metrics, options)."""
