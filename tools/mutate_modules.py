"""The modules `tools/mutate.py` mutates, each with the fast tests written for it."""

# name: (module, the tests that exist for it). Chosen to run in seconds, so a module's mutants
# take minutes, not hours; the rest of the suite adds time, not kills.
MODULES = {
    # Worlds 2 to 5 of the ring test (it runs 2 to 8 in the suite): 8 forked ranks on 2 cores per
    # mutant would double the module's time and kill nothing the smaller worlds leave alive.
    "ring": ("src/meshlm/comm/ring.py", [
        *(f"tests/test_comm_ring.py::test_ring_algorithms_equal_the_library_collectives[{n}]" for n in (2, 3, 4, 5)),
        "tests/test_comm_cost.py::test_per_rank_traffic_equals_the_formulas_exactly",
        "tests/test_comm_cost.py::test_bus_factors_and_steps_are_the_ring_formulas"]),
    "vocab_parallel": ("src/meshlm/parallel/vocab_parallel.py",
                       ["tests/test_vocab_parallel.py", "tests/test_tensor_parallel.py", "-k",
                        "vocab or boundary or logits_loss_and_every_gradient"]),
    "data_parallel": ("src/meshlm/parallel/data_parallel.py",
                      ["tests/test_zero.py", "-k", "every_stage_equals or bf16 or engine_and_its"]),
    "flat_buffer": ("src/meshlm/parallel/flat_buffer.py",
                    ["tests/test_flat_buffer.py", "tests/test_ddp.py",
                     "tests/test_zero.py::test_every_stage_equals_the_single_process_reference",
                     "-k", "flat_buffer or equals_torch or unused or every_stage"]),
    "schedules": ("src/meshlm/parallel/pipeline/schedules.py", ["tests/test_pipeline_schedules.py"]),
    # The config's cross-key checks are tested beside the techniques they guard (layouts in
    # test_mesh, pipelines in test_pipeline_schedules, model.init_from in test_hf_interop).
    "config": ("src/meshlm/config.py", [
        "tests/test_config.py", "tests/test_mesh.py",
        "tests/test_pipeline_schedules.py::test_bad_pipeline_configs_fail_before_ranks_start_naming_the_key",
        "tests/test_pipeline_schedules.py::test_a_valid_pipeline_config_resolves",
        "tests/test_hf_interop.py::test_config_comes_from_the_source_and_contradictions_name_the_key",
        "-k", "not cli_exits"]),
    "config_ranges": ("src/meshlm/config_ranges.py", ["tests/test_config.py", "-k", "not cli_exits"]),
    # The chunked cross-entropy: against F.cross_entropy (dtypes, consumed logits, ignored targets)
    # and, vocabulary-parallel, against one process across shard boundaries.
    "loss": ("src/meshlm/model/loss.py", ["tests/test_model.py", "tests/test_vocab_parallel.py",
                                          "-k", "chunked_loss or logits_and_loss or vocab or loss"]),
    # The segment AdamW, the gradient upcast and clipping under every data-parallel engine.
    "mixed_precision": ("src/meshlm/parallel/mixed_precision.py", [
        "tests/test_zero.py", "tests/test_grad_norm.py", "tests/test_ddp.py", "tests/test_ddp_bf16.py",
        "-k", "not bench and not overlap and not bytes_on_the_wire and not tracker and not flat_layout"]),
    # DDP: against torch's DDP at worlds 1 and 2, overlap, no_sync, bytes on the wire, unused
    # parameters, bf16; the trainer's accumulation at one rank (autograd's own gradients).
    "ddp": ("src/meshlm/parallel/ddp.py", [
        "tests/test_ddp.py", "tests/test_ddp_bf16.py",
        "tests/test_trainer.py::test_accumulation_equals_a_plain_pytorch_loop", "-k", "not bench"]),
    # ZeRO-1/2 on the DDP reducer: every stage against one process and torch's DDP, the bytes each
    # stage holds, and its peak memory against the formulas.
    "zero": ("src/meshlm/parallel/zero.py", [
        "tests/test_zero.py", "tests/test_ddp.py", "tests/test_ddp_bf16.py", "tests/test_memory.py",
        "-k", "not bench and (zero or stage or every or equals or accumulation or bf16 or state_tensors)"]),
    # FSDP/ZeRO-3: against torch's fully_shard (with and without reshard_after_forward), one process
    # (worlds 2 and 4, accumulation, bf16, recompute, any module), bytes on the wire, model state
    # and peak memory against the formulas, clipping that binds; the memory schedule (what is
    # gathered when, the embedding cut off after forward, prefetches in flight).
    "fsdp": ("src/meshlm/parallel/fsdp.py", [
        "tests/test_fsdp.py", "tests/test_fsdp_schedule.py", "tests/test_zero.py", "tests/test_memory.py",
        "tests/test_grad_norm.py", "tests/test_ddp.py::test_state_tensors_are_what_model_state_bytes_counts",
        "-k", "not loss_curve and (fsdp or fully_shard or checkpointing or wire or size_policy or stage or "
              "accumulation or bf16 or state_bytes or zero or grad_norm)"]),
    # TP/SP layers: against DTensor's parallelize_module and one process (tp 2 and 4, replicated KV
    # heads, sequence parallel), bytes against the formulas, activation memory per layer; which
    # replica of a replicated kv head writes it to a checkpoint (tp4).
    "tensor_layers": ("src/meshlm/parallel/tensor_layers.py", [
        "tests/test_tensor_parallel.py", "tests/test_vocab_parallel.py",
        "tests/test_checkpoint.py::test_stored_tensors_equal_the_gathered_weights[tp4]", "-k", "not loss_curve"]),
    # The TP plan and its application (GQA kv-head replication, SP norms, the comm formulas), and
    # the activation formulas against the published ones (Korthikanti et al.).
    "tensor": ("src/meshlm/parallel/tensor.py", [
        "tests/test_tensor_parallel.py", "tests/test_vocab_parallel.py", "tests/test_memory_published.py",
        "tests/test_checkpoint.py::test_stored_tensors_equal_the_gathered_weights[tp4]", "-k", "not loss_curve"]),
    # Ring attention: against full causal attention (GQA, fused and not), the load-balanced layout,
    # a CP run against one process, ring bytes against the formula.
    "context": ("src/meshlm/parallel/context.py", ["tests/test_context_parallel.py", "-k", "not loss_curve"]),
    # The pipeline engine: every schedule against one process (pp 2-8, fewer micro-batches than
    # stages, recompute, dp x pp, tied embeddings with ZeRO, a stage without parameters; with
    # sequence-parallel boundaries) and against torch.distributed.pipelining; deferred weight
    # gradients and where they run; the engine's contract (no_sync, batching, timings, ordering).
    "engine": ("src/meshlm/parallel/pipeline/engine.py", [
        "tests/test_pipeline.py", "tests/test_pipeline_zero.py", "tests/test_deferred_wgrad.py",
        "tests/test_pipeline_engine.py",
        "tests/test_pipeline_sim.py", "tests/test_composition.py::test_dp_tp_sp_pp_on_eight_ranks_equals_one_process[1]",
        "-k", "not loss_curve"]),
    # Checkpoint files: atomic directories, manifests and checksums, rotation, the rectangle
    # reader; resume and reshard against the uninterrupted run, corruption and crashes.
    "store": ("src/meshlm/train/checkpoint/store.py", [
        "tests/test_checkpoint_store.py", "tests/test_checkpoint.py", "tests/test_checkpoint_cli.py",
        "-k", "store or single_process_resume or chain or background or stored_tensors or corrupt or no_good or "
              "bad_resume or fresh_start or async_save"]),
    # A trainer's whole state, saved and loaded: exact resume against the uninterrupted run on every
    # layout, reshard between layouts, the background save, signals and crashes, what is stored.
    "checkpoint_state": ("src/meshlm/train/checkpoint/state.py", [
        "tests/test_checkpoint.py", "tests/test_checkpoint_pieces.py", "tests/test_checkpoint_store.py",
        "tests/test_checkpoint_cli.py"]),
    # The planner's step-time model: FLOPs at a stated efficiency, each axis's communication in the
    # alpha-beta model, the simulated bubble; against published setups and hand-derived costs.
    "steptime": ("src/meshlm/analysis/steptime.py", ["tests/test_plan.py", "tests/test_plan_steptime.py"]),
    # The messages it prices: each rank's flight recorder in real runs, op by op and byte for byte.
    "messages": ("src/meshlm/analysis/messages.py", ["tests/test_plan_messages.py", "tests/test_plan.py",
                                                     "tests/test_plan_steptime.py"]),
    # Which checkpoint a run continues from: auto, never, a path; the launcher's checks before
    # any rank starts, the ranks' shared verification, a restart always resuming.
    "resume": ("src/meshlm/train/checkpoint/resume.py", [
        "tests/test_checkpoint_cli.py", "tests/test_checkpoint_store.py", "tests/test_checkpoint.py"]),
    # Sharded construction: every layout's shards equal the single-process init, each rank
    # allocating only its own (a 1b model within its shard); the trainer under TP + SP, whose
    # norms' gradient hooks survive the swap from meta.
    "sharded_init": ("src/meshlm/parallel/sharded_init.py", [
        "tests/test_sharded_init.py", "tests/test_tensor_parallel.py::test_trainer_steps_equal_the_single_process_run"]),
    # The shared-memory collectives: against gloo at n = 2-4, every op and dtype, the window's
    # sizing and fallbacks.
    "shared_memory": ("src/meshlm/comm/shared_memory.py", ["tests/test_shared_memory.py", "tests/test_comm.py",
                                                          "tests/test_comm_cost.py", "tests/test_comm_ring.py",
                                                          "tests/test_shared_memory_window.py", "-k", "not bench"]),
    # The trainer's pipeline seam: every schedule against one process (losses, gradients, tied
    # embeddings across stages under every ZeRO stage, evaluation, gathered weights), the step
    # metrics against their definitions, a pipeline checkpoint's stored weights.
    "runner": ("src/meshlm/parallel/pipeline/runner.py", [
        "tests/test_pipeline.py", "tests/test_pipeline_zero.py", "tests/test_pipeline_runner.py",
        "tests/test_checkpoint.py::test_stored_tensors_equal_the_gathered_weights", "-k", "not loss_curve"]),
    # The memory model (its walk, and its terms): every window of the step against its measured
    # live bytes, the measured per-rank peak (every ZeRO stage, the pipeline's micro-batches in
    # flight), parameter counts against the built model, the published tables and formulas (ZeRO
    # paper, Korthikanti et al.).
    "memory": ("src/meshlm/analysis/memory.py", ["tests/test_memory_phases.py", "tests/test_memory.py",
                                                 "tests/test_memory_published.py"]),
    "memory_schedule": ("src/meshlm/analysis/memory_schedule.py", ["tests/test_memory_phases.py", "tests/test_memory.py",
                                                                   "tests/test_memory_published.py"]),
    "memory_terms": ("src/meshlm/analysis/memory_terms.py", ["tests/test_memory_phases.py", "tests/test_memory.py",
                                                             "tests/test_memory_published.py"]),
    "memory_state": ("src/meshlm/analysis/memory_state.py", ["tests/test_memory_phases.py", "tests/test_memory.py",
                                                             "tests/test_memory_published.py"]),
    # The pipeline simulator: the schedules' published bubbles, the engine's semantics, and the
    # step metrics it predicts from measured op costs.
    "pipeline_sim": ("src/meshlm/analysis/pipeline_sim.py", [
        "tests/test_pipeline_sim.py", "tests/test_pipeline_runner.py", "tests/test_pipeline_schedules.py",
        "tests/test_plan_steptime.py::test_long_pipelines_extend_the_simulation_by_steady_state_cycles"]),
    # Activation checkpointing changes no value, only what is stored: the peak memory per config
    # (full and selective against the model), the compiled blocks that must still recompute, and
    # the gradients that must stay equal.
    "recompute": ("src/meshlm/parallel/recompute.py", [
        "tests/test_memory.py", "tests/test_compile.py",
        "tests/test_trainer.py::test_activation_checkpointing_gives_the_same_gradients",
        "tests/test_fsdp.py::test_activation_checkpointing_gives_the_same_result",
        "tests/test_trainer.py::test_an_unknown_recompute_mode_is_refused_by_name",
        "tests/test_plan_messages.py::test_every_message_of_a_micro_batch_is_the_models[tp2-sp-pp2-autocast-full]"]),
    # The one door of every collective: bytes each rank sends and receives, groups of one, dtype
    # checks, handles and the GPU stall accounting, the window and ring paths it picks on gloo.
    "traced": ("src/meshlm/comm/traced.py", ["tests/test_comm.py", "tests/test_comm_cost.py", "tests/test_comm_ring.py",
                                            "tests/test_comm_bench.py", "tests/test_shared_memory.py"]),
    # The layout planner: which layouts it considers, what it prunes and why, the pick it prints.
    "plan": ("src/meshlm/analysis/plan.py", ["tests/test_plan.py", "tests/test_plan_steptime.py"]),
    # The futex barrier on its own (threads, two processes, dead and absent peers), and the
    # shared-memory collectives that stand on it.
    "shm_barrier": ("src/meshlm/comm/shm_barrier.py", [
        "tests/test_shm_barrier.py",
        "tests/test_shared_memory.py::test_window_collectives_equal_gloo_and_are_identical_on_every_rank",
        "tests/test_shared_memory.py::test_the_futex_barrier_runs_wherever_its_conditions_hold"]),
    # Blends: the per-block quotas, the sampler's corpus and sample numbers, the loader's batches
    # (pure in seed and step, tiled over dp, resumed), the config's errors, per-corpus evaluation.
    "blend": ("src/meshlm/data/blend.py", ["tests/test_data_blend.py"]),
    # Shard files: identical tokens and document offsets for any worker count and shard size, resume
    # after SIGKILL, torn markers, durable markers, `data inspect`'s longest documents and counts.
    "shards": ("src/meshlm/data/shards.py", [
        "tests/test_data_prepare.py", "tests/test_data_prepare_resume.py", "tests/test_data_prepare_bad_input.py",
        "tests/test_data.py::test_prepare_data_round_trips_and_is_cached",
        "tests/test_data_blend.py::test_inspect_reports_documents_tokens_longest_and_epochs_with_a_warning",
        "-k", "not peak_memory and not bench_data"]),
    # The token cache's door and the loader: batches pure in (seed, step) and tiled over dp, every
    # window once an epoch, resume and its checks, held-out batches and their dp shares, blends.
    "train_data": ("src/meshlm/train/data.py", ["tests/test_data.py", "tests/test_data_blend.py"]),
    # Hang verdicts from synthetic dumps: the rank never entered, followed to the one waiting on
    # nothing, a missing p2p half, a GPU hang from how far each rank queued, deadlocks and cycles,
    # ranks of other nodes (the tests that train a real run to get their dumps are left out).
    "hang": ("src/meshlm/debug/hang.py", [
        "tests/test_debug.py", "tests/test_debug_checks.py", "tests/test_debug_verdicts.py",
        "-k", "not restarted and not skip_drops and not stop_raises and not unequal_evaluation and not oom and "
              "not waits_for_its_peers and not barrier_timeout_is_dumped and not barrier_gives_up"]),
    # The alpha-beta cost model: steps, bus factors and per-rank bytes against the ring formulas
    # (and the ring's own counted bytes), tiers, the fit, profiles; `bench comm` and doctor against
    # it; the planner, its main user.
    "cost": ("src/meshlm/comm/cost.py", ["tests/test_comm_cost.py", "tests/test_comm.py", "tests/test_comm_ring.py",
                                         "tests/test_comm_bench.py", "tests/test_doctor.py",
                                         "tests/test_plan.py", "tests/test_plan_steptime.py",
                                         "-k", "not tracing_overhead"]),
    # Checkpoint pieces: every flat range's rectangles against the elements, a shard's offset and
    # padding, the shape check; the stored tensors against the gathered weights (dp, tp, pp, tp4's
    # replicated kv heads) and reshards between layouts, which place every piece of every rank.
    "pieces": ("src/meshlm/train/checkpoint/pieces.py", [
        "tests/test_checkpoint_pieces.py", "tests/test_checkpoint.py", "-k",
        "pieces or stored_tensors or reshard"]),
    # The Llama decoder: logits and loss against Hugging Face's LlamaForCausalLM (MHA, GQA, MQA,
    # tied), RMSNorm and RoPE against their formulas, causality, explicit positions, bf16, the tied
    # head, meta init, parameter counts.
    "llama": ("src/meshlm/model/llama.py", ["tests/test_model.py"]),
    # Deferred weight gradients: equal to the plain backward (recompute, autocast), accumulated
    # through autograd one weight at a time, the plain path when unarmed; the engine sending the
    # input gradient first; every pipeline schedule against one process, with owed gradients in
    # the data-parallel reduction.
    "deferred_wgrad": ("src/meshlm/parallel/pipeline/deferred_wgrad.py", [
        "tests/test_deferred_wgrad.py", "tests/test_pipeline.py", "tests/test_pipeline_zero.py",
        "tests/test_compile.py::test_compiled_blocks_train_as_one_eager_process_on_layouts[pp2]", "-k", "not loss_curve"]),
    # FSDP units: which modules the policies make units (by class, by size bottom-up, a tied weight
    # left to the common ancestor), each unit's shard, gathers, trims and frees: against torch's
    # fully_shard and one process, the memory schedule, the accounted state.
    "fsdp_units": ("src/meshlm/parallel/fsdp_units.py", [
        "tests/test_fsdp.py", "tests/test_fsdp_schedule.py",
        "tests/test_ddp.py::test_state_tensors_are_what_model_state_bytes_counts", "-k", "not loss_curve"]),
    # The trained model's directory: final/ written atomically and read back (generate's greedy text
    # against transformers', an export's weights and logits against LlamaForCausalLM), a checkpoint
    # of any layout assembled to the saved weights, which of final/ and the newest checkpoint a run
    # directory names (and the warning when they disagree), bad paths.
    "weights": ("src/meshlm/train/weights.py", [
        "tests/test_hf_export.py", "tests/test_hf_interop.py", "tests/test_generate.py", "tests/test_e2e.py",
        "tests/test_config.py::test_generate_help_names_every_source_it_reads",
        "-k", "not two_nodes and not signal_stops and not config_error_only and not each_node"]),
    # Initialisation: the distributions (std 0.02, residual projections over sqrt(2 * layers), norms
    # at 1), seeds per name, the streamed row blocks against the one-call draw, every sharded
    # layout's shards against the single-process init; parameter counts against the built model
    # and Meta's published totals. The 1b construction test is left out (30 s a run).
    "init": ("src/meshlm/model/init.py", ["tests/test_model.py", "tests/test_sharded_init.py", "-k", "not 1b_model"]),
    # Hugging Face interop, both ways: exports under every layout loaded by transformers'
    # LlamaForCausalLM (weights, logits, greedy text, tokenizer), init_from a transformers Llama
    # (sharded files, tied, llama3 rope scaling) giving every layout its weights, import, bad
    # sources and configs; the renaming against LlamaForCausalLM's logits in test_model.
    "hf_import": ("src/meshlm/train/checkpoint/hf_import.py", ["tests/test_hf_interop.py", "tests/test_hf_export.py"]),
    "hf": ("src/meshlm/train/checkpoint/hf.py", [
        "tests/test_hf_interop.py", "tests/test_hf_export.py", "tests/test_model.py::test_logits_and_loss_match_hugging_face"]),
    # Export: every saved layout's export loaded by transformers' LlamaForCausalLM (weights bit for
    # bit, logits, greedy text, tokenizer, bf16, llama3 rope scaling, the end token), from a final/
    # too, and which --out it may replace.
    "hf_export": ("src/meshlm/train/checkpoint/hf_export.py", ["tests/test_hf_export.py", "tests/test_hf_interop.py"]),
    # The global gradient norm: the reported norm and the weights after clipped steps against one
    # process on every layout of worlds 2-4 (ZeRO 0-3, tp with replicated norms and kv heads, sp,
    # cp, pp with a tied embedding, interleaved, and their products); the norm on its own at
    # tp 2 x dp 2 x pp 2, summed over dp only when sharded.
    "grad_norm": ("src/meshlm/parallel/grad_norm.py", ["tests/test_grad_norm.py"]),
    # AdamW and the learning rate: the schedule against its formulas (warmup, cosine, WSD's
    # linear, sqrt and cosine decays, a decay shorter than one update, the floor past the last),
    # the scaling rules (ratios that are not whole, unknown names); build_optimizer as the reference that
    # meshlm's SegmentAdamW and DDP must equal (decay groups, betas, eps); the trainer against a
    # plain torch loop with its own schedule.
    "optim": ("src/meshlm/train/optim.py", [
        "tests/test_train_utils.py", "tests/test_ddp.py::test_equals_torch_distributed_data_parallel",
        "tests/test_zero.py::test_segment_adamw_equals_torch_adamw_with_the_decay_groups_of_build_optimizer",
        "tests/test_trainer.py::test_accumulation_equals_a_plain_pytorch_loop",
        "-k", "lr or warmup or decay or rate or equals"]),
    # The pipeline's messages: which connection each direction travels on gloo (one batch on
    # NCCL), one spec exchange per shape, every spec's encoding, both sides' errors; the engine's
    # contract at pp 2 (batching per backend, ordering, timings); stages that disagree on a shape
    # fail on both sides; schedules against one process at pp 4 (interleaved: the wrap from the
    # last stage to the first), dp x pp, bf16 activations, and against torch.distributed.pipelining.
    # (The 8-stage and ZeRO cases add minutes per mutant, not kills: a mutant that loses a message
    # hangs every one of them until its timeout.)
    "p2p": ("src/meshlm/parallel/pipeline/p2p.py", [
        "tests/test_pipeline_p2p.py", "tests/test_pipeline_engine.py",
        "tests/test_pipeline.py::test_stages_that_disagree_on_activation_shapes_fail_clearly_instead_of_hanging",
        "tests/test_pipeline.py::test_pipeline_equals_single_process[4-interleaved-2-2]",
        "tests/test_pipeline.py::test_pipeline_equals_single_process[4-1f1b-1-4]",
        "tests/test_pipeline.py::test_data_parallel_times_pipeline_equals_single_process[interleaved-2]",
        "tests/test_pipeline.py::test_bf16_weights_pipeline_equals_single_process[1-interleaved-2]",
        "tests/test_pipeline.py::test_gradients_equal_torch_pipelinings_for_the_same_stages_and_schedule"]),
    # Pipeline stages: the layer split against its properties (contiguous, balanced, larger first;
    # explicit splits and bad ones); the sharded build of pp layouts (tp x pp with a tied embedding,
    # interleaved) against the single-process init; schedules against one process with chunks, a
    # tied embedding across stages (and under ZeRO), stages and chunks without layers; the gather of
    # every stage's weights on rank 0 and a tp x pp checkpoint's stored tensors; clipped steps
    # against one process at world 4 (with tp 2 x sp x pp 2: sequence shards between stages).
    "stage": ("src/meshlm/parallel/pipeline/stage.py", [
        "tests/test_pipeline_stage.py", "tests/test_pipeline_runner.py",
        "tests/test_sharded_init.py::test_sharded_build_equals_the_single_process_init[tp2-pp2-tied]",
        "tests/test_sharded_init.py::test_sharded_build_equals_the_single_process_init[pp2-interleaved-zero1]",
        "tests/test_pipeline.py::test_pipeline_equals_single_process[4-interleaved-2-2]",
        "tests/test_pipeline_zero.py::test_tied_embeddings_stay_in_sync_across_first_and_last_stage",
        "tests/test_pipeline_zero.py::test_tied_embeddings_across_stages_with_zero[1]",
        "tests/test_pipeline_zero.py::test_a_stage_without_parameters_does_not_break_data_parallelism",
        "tests/test_pipeline_zero.py::test_zero3_interleaved_with_a_chunk_of_no_layers_equals_single_process[2,0,3,3]",
        "tests/test_pipeline.py::test_weight_gradients_owed_at_the_last_backward_are_in_the_data_parallel_reduction",
        "tests/test_checkpoint.py::test_stored_tensors_equal_the_gathered_weights[tp2-pp2]",
        "tests/test_grad_norm.py::test_grad_norm_and_clipping_equal_one_process[4]"]),
    # The layout and its process groups: rank arithmetic against brute-force enumeration for
    # hundreds of shapes, pipeline neighbours and embedding groups, the layout checks naming their
    # key (and the config's explicit pipeline split), every rank's groups and stage at worlds 4-8,
    # one stage included; the backend and device picked (doctor's GPU tests).
    "mesh": ("src/meshlm/mesh.py", [
        "tests/test_mesh.py", "tests/test_doctor.py::test_gpu_shortfall",
        "tests/test_doctor.py::test_train_with_more_ranks_than_gpus_is_one_line_and_exit_2",
        "tests/test_doctor.py::test_nccl_asked_for_without_cuda_is_one_line_and_exit_2",
        "tests/test_doctor.py::test_gloo_asked_for_on_a_gpu_machine_runs_on_the_cpu",
        "tests/test_config.py::test_an_explicit_pipeline_split_must_cover_every_layer_once"]),
    # The step's line and byte counts against hand-written strings, nulls for NaN, the terminal's
    # bar and TensorBoard through stand-ins (test_metrics.py); metrics.jsonl's resume (rows kept,
    # cut, taken back from .old, the checkpoint's row), the rank log on a full disk, which steps
    # the console shows.
    "metrics": ("src/meshlm/train/metrics.py", [
        "tests/test_metrics.py", "tests/test_checkpoint_resume.py", "tests/test_train_utils.py",
        "-k", "test_metrics or metrics or full_disk or rank_log or console"]),
    # The flight recorder: on a clock the test moves, the seconds blocked (the step's exposed
    # communication), times, bandwidths and the table, the fingerprints against zlib, wall-clock
    # stamps (test_recorder.py); the bounded ring and its totals, GPU stalls against overlapped
    # work, exact bytes per op, P2P records, fingerprints of real ranks, a dropped send's record.
    "recorder": ("src/meshlm/comm/recorder.py", [
        "tests/test_recorder.py",
        *(f"tests/test_comm.py::test_{name}" for name in (
            "recorder_is_bounded_but_the_summary_counts_everything",
            "gpu_stalls_count_what_the_stream_waited_not_what_overlapped",
            "groups_of_one_rank_communicate_nothing_and_record_nothing",
            "traced_collectives_record_exact_bytes", "point_to_point_records_and_merged_handles_complete")),
        "tests/test_debug_checks.py::test_traced_collectives_fingerprint_op_shape_and_dtype_and_count_blocked_time",
        "tests/test_pipeline_engine.py::test_a_send_dropped_as_finished_is_waited_so_its_record_closes"]),
    # train.compile: compiled blocks (and the whole forward on one process) against the eager run on
    # one process and on dp2-zero3, tp2 with recompute and pp2, graphs and calls counted; the loss's
    # compiled chunk kernels against the eager loss and their chunk sizes; the memory tracker's
    # steps running eagerly. The inductor cases are left out (minutes of code generation each).
    "compile": ("src/meshlm/parallel/compile.py", ["tests/test_compile.py", "-k", "not inductor"]),
    # The training loop: against a plain PyTorch loop (accumulation, dp 2 and 4, uneven target
    # counts, no clipping), recompute, bf16, evaluation over micro-batch sizes and dp layouts, an
    # empty global batch, no autograd graph left alive, stops and saves; non-finite steps skipped
    # or stopping, a desync at its step; one CLI run's metrics rows and warmup warning; a blend's
    # per-corpus held-out losses.
    "trainer": ("src/meshlm/train/trainer.py", [
        "tests/test_trainer.py", "tests/test_e2e.py::test_single_process_run_writes_the_run_directory_contract",
        "tests/test_data_blend.py::test_training_on_a_blend_logs_each_corpus_held_out_loss",
        *(f"tests/test_debug_checks.py::test_{name}" for name in (
            "skip_drops_the_nonfinite_update_and_training_goes_on",
            "stop_raises_on_every_rank_naming_the_rank_whose_loss_went_bad",
            "unequal_evaluation_work_is_not_a_desync",
            "a_desync_raises_at_its_step_on_every_rank"))]),
}
