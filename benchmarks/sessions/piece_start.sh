#!/usr/bin/env bash
# Session 4, call 6: host updates started per piece in backward (COMMIT=4e4f036): the same
# rows as call 4 (engine and plan GPU tests, full-3b auto, FSDP2 beside it, lora-14b auto).
exec bash benchmarks/sessions/chunk_search.sh
