"""Files on disk, one module per job: where the cache lives and files' hashes (`cache`), durable writes
and what killed processes leave behind (`durable`), and checking JSON read back (`schema`)."""
