#!/usr/bin/env bash
# A stand-in for the engine venv's python: `-c` (the version probe) prints vLLM's version; a run of
# engine_worker.py runs tests/serving/fake_engine_worker.py instead, with the python running the tests.
if [ "$1" = "-c" ]; then echo "0.32.0"; exit 0; fi
exec "${FAKE_ENGINE_REAL_PYTHON:?}" "$(dirname "$0")/fake_engine_worker.py" "${@:2}"
