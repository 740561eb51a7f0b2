"""What upstream Dynamo does in Rust, in Python: lifecycle, system server, discovery, metrics."""
