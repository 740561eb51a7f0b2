"""Small helpers shared across `dynamo.common` (environment parsing, namespaces, endpoints)."""
