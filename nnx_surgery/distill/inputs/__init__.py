"""What a distillation reads: text sources, token batches (packing, multi-host shards), the
byte tokenizer for demos, and the teacher cache (its format and its writer/reader)."""
