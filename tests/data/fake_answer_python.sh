#!/usr/bin/env bash
# A stand-in for the engine venv's python: `-c` (the version probe) prints a version; a run of engine_worker.py
# runs tests/data/fake_answer_engine.py instead, with the python running the tests.
if [ "$1" = "-c" ]; then echo "0.0.fake"; exit 0; fi
exec "${FAKE_ENGINE_REAL_PYTHON:?}" "$(dirname "$0")/fake_answer_engine.py" "${@:2}"
