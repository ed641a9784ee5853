"""The HTTP API: routes, the error table, /metrics exposition and the EPP endpoint."""
