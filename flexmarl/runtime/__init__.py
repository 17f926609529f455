"""The process a run lives in: its workdir, memory (host, GPU shares, the report), the compile cache, malloc and Ctrl-C."""
