"""kvstore: shared prefix KV blocks across executors (see issue 5)."""
