"""Where artifacts live and how they are written; torch-free, and imports nothing else of the library.

storage.py  local directory or GCS bucket behind one interface, and the local mirror of remote artifacts
records.py  the prompt and conversation schemas, JSONL reading and atomic writes, hashes
paths.py    the cache root and its scratch and working-copy directories
checks.py   checks on the output paths a stage is given, before any work
"""
