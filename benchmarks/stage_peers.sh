#!/usr/bin/env bash
# Stages the peers' own draft-model code for `qwen_session.sh qpeers` (benchmarks/peer_check.py)
# on a lent GPU host with no registry: .stash/peers, the Python 3.12 wheels of SGLang 0.5.23 and
# speculators 0.9.0 and of the packages their model modules import that the host's image lacks
# (the versions `make test` runs the tests/formats peers with). Installed there with --no-deps:
# only the model modules are imported (SGLang's through tests/formats/sglang_runner.py, which
# stands in for its serving packages). Carried in one call (under 60 MB: the sizes are listed).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .stash/peers && mkdir -p .stash/peers
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .stash/peers \
  sglang==0.5.23 speculators==0.9.0 hs-connectors==0.9.0 loguru==0.7.3 pydantic==2.14.4 \
  pydantic-core==2.50.5 pydantic-settings==2.16.3 python-dotenv==1.2.4 annotated-types==0.8.0 \
  typing-inspection==0.4.5 openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 sniffio==1.3.1 \
  distro==1.9.0 jiter==0.19.0 truststore==0.10.5 googleapis-common-protos==1.76.0 \
  typing-extensions==4.16.0 anyio==4.16.0 idna==3.20  # newer than the image's may be
ls -l .stash/peers | awk 'NR > 1 {printf "%10d  %s\n", $5, $9}'
du -sh .stash/peers
