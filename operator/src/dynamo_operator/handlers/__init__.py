"""kopf handlers: glue only (parse, call reconcile, write status)."""
