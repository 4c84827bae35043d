"""The process the gates run in: torchrun ranks and shards, devices, CPU threads, the allocator, memory sizes, progress (imports the core, data/ and files/)."""
