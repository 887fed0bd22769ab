"""The built-in JAX rollout engine: the learner's own model code, sampling with a KV cache.

``JaxEngine(model, tokenizer=..., mesh=...)`` runs ``Transformer.decode`` (``rlx.models.kv_cache``)
on the very weights the learner trains: full mode full parameters, or LoRA mode's frozen quantized base
(int8/int4/nf4/fp8 ``QTensor``s, GGUF blocks) plus LoRA adapters, without any conversion.
``update_weights(weights, version)`` takes a new model, or an ``nnx.State`` holding some of its
variables (e.g. only the ``nnx.LoRAParam`` adapters in LoRA mode), in memory; with unchanged shapes and
dtypes nothing is recompiled. Weights are copied by default, so that the learner may donate its
buffers to its next step while the engine still samples from the previous version. Variables that
match ``shared`` (an nnx filter; a run passes its frozen part, which no update donates:
``rlx.learner.compiled.UpdatePerShape``) are never copied: the engine samples from the very arrays the
caller holds, on their own shardings, so LoRA mode's frozen base exists once and each update copies
only the adapters (full mode: every parameter, as each update donates them). On XLA:CPU the
engine's own copy holds float projection kernels transposed, ``[out, in]``, the faster layout of a
decode step's products there (``weight_layout``, ``rlx.rollout.jax.decode_layout``); updates in the
learner's layout are transposed on arrival. Shared kernels keep the learner's layout: a transposed
copy of them would be the second copy of the base that sharing avoids. For multi-head latent
attention models (DeepSeek-V3, Kimi-K2) the cache holds each token's latent and shared rotary key
and decode steps absorb ``kv_b_proj`` (``rlx.models.mla``). With an MoE model's experts split
over the mesh's ``expert`` axis, tokens go to their experts' devices, as the learner's do
(``rlx.models.moe_dispatch``, dropless unless ``capacity_factor`` > 0; ``dropped_pairs()``
counts the pairs a capacity drops, logged per batch as ``rollout/moe_dropped_pairs``). Gated
DeltaNet layers (Qwen3-Next) carry their states per row in the ``KVCache``: lockstep, no prefix.
``record_routes=True`` (routing replay, ``config.train.router_replay``) puts on each rollout
the experts every MoE layer chose for its prompt and completion tokens (``Rollout.routes``, -1
on the completion's last token, which is never fed).

Batching (``settings``, ``config.rollout.jax``): by default continuously, over a paged KV cache
(``rlx.rollout.jax.paged``): a fixed number of decode slots; a finished sequence leaves its slot
at once and the next request takes it; prompts are prefilled in chunks between bursts of decode
steps; the ``n`` samples of a prompt share its pages; on a mesh each data shard has its pool
and block of slots, the ``context`` devices too (``context_as_rows``). Inside
``prefix_cache()`` finished sequences' pages stay indexed by their tokens, so an episode's next
turn prefills only its new tokens (``prefilled_tokens()`` counts what is fed; not while routes
are recorded). ``batching_stats()``: decode steps, slot occupancy and preemptions of the last
call. ``batching="lockstep"``, and any mesh across processes: requests expanded to ``n`` rows
per prompt, sorted by length, cut into device batches padded to power-of-two buckets
(``rlx.rollout.jax.batching``; ``compilations()`` counts programs), each run until its longest
row ends (``rlx.rollout.jax.sampling``; a sequence's cache split over the context devices), with
a row-gathering prefix cache (``rlx.rollout.jax.prefix_cache``). Either way a request's tokens
do not depend on the requests beside it: samples are keyed by (seed, prompt uid, sample index).

Stopping: a row ends on any of ``sampling.stop_token_ids`` (kept; end-of-sequence is not
implicit), at the token that completes one of ``sampling.stop_strings`` (matched on the device,
``rlx.rollout.jax.stops``) or after ``max_new_tokens``. The host checks the decoded text too (for
a tokenizer without token bytes, the only check), cutting after a stop string's first token.

``sampler_logp`` is the raw policy's log-prob of each sampled token (temperature 1, no top-k/top-p
truncation): the quantity the learner recomputes, see ``rlx.rollout.jax.sampling``.
``SamplingParams(logprobs=False)`` skips computing it: NaN throughout, ``has_logprobs`` False.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rlx.platform.compiled import CompiledPerShape
from rlx.mesh import (SAMPLE_RULES, LogicalRules, batch_sharding, batch_shards, context_as_rows,
                      host_values, variable_shardings)
from rlx.models.moe import SparseMoE
from rlx.models.parallel import parallelize
from rlx.models.stack import cache_stacks
from rlx.platform.policy import PlatformPolicy, current, policy_of
from rlx.rollout.jax.batching import Buckets, pack_left, row_rollout, shared_prompts, uid_hash
from rlx.rollout.jax.cache_layout import cache_sharding, stacked
from rlx.rollout.jax.config import JaxSection
from rlx.rollout.jax.decode_layout import resolve_layout, to_out_in, transpose_update
from rlx.rollout.errors import RolloutError
from rlx.rollout.jax.paged import PagedServing
from rlx.rollout.jax.prefix_cache import CachedRow, PrefixCache, gather_plan, prompt_slots
from rlx.rollout.jax.sampler import Knobs, SamplerSpec
from rlx.rollout.jax.sampling import (GenerateStatic, KeptPrefix, gather_prefix,
                                      generate_batch, sequence_logprobs)
from rlx.rollout.jax.scheduler import Stats
from rlx.rollout.jax.stops import StopTable, device_stops, stop_table
from rlx.types import Prompt, Rollout, SamplingParams


def _eval_split(model: nnx.Module, layout: str, shared, mesh: Mesh | None = None,
                rules: LogicalRules = SAMPLE_RULES, capacity_factor: float | None = None,
                policy: PlatformPolicy | None = None
                ) -> tuple[nnx.GraphDef, nnx.State, frozenset, frozenset, tuple | None]:
    """Split a copy of ``model`` in eval mode (LoRA dropout off), its MoE layers dispatching
    tokens to experts split over ``mesh`` (``rlx.models.parallel.parallelize``), and in the
    engine's weight ``layout`` (``rlx.rollout.jax.decode_layout``; ``shared`` variables keep theirs),
    leaving ``model`` untouched; also the paths of the kernels held transposed and of the
    ``shared`` variables, and the copy's cache layout (``rlx.models.stack.cache_stacks``)."""
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    copy.eval()
    copy.unroll_decode = unroll_decode(state, policy or current())
    parallelize(copy, mesh, rules, capacity_factor)
    keep = frozenset(tuple(p) for p, _ in nnx.to_flat_state(nnx.state(copy, shared)))
    transposed = to_out_in(copy, keep) if layout == "out_in" else frozenset()
    return (*nnx.split(copy), transposed, keep, cache_stacks(copy))


def unroll_decode(state: nnx.State, policy: PlatformPolicy) -> bool:
    """Whether decode programs unstack a scanned model's layers (``rlx.models.stack.decode_model``:
    the stacks sliced per layer inside the program, once ahead of its token loop; one cache
    buffer per layer): where the platform's ``policy`` says so, for weights up to its
    ``unroll_decode_bytes`` (XLA:CPU: 1 GiB). Scanning a stack at every token makes XLA:CPU copy
    each layer's weights and cache out of the stack, and the cache's layers back in; unstacked,
    the program holds the sliced weights (and each layer's float conversions, hoisted out of the
    token loop) for the whole call: about a float copy of the weights, too much for a large one."""
    weights = sum(x.nbytes for x in jax.tree.leaves(state) if hasattr(x, "nbytes"))
    return policy.unroll_decode_bytes is not None and weights <= policy.unroll_decode_bytes


class JaxEngine:
    """``RolloutEngine`` on the learner's own model (see the module docstring)."""

    name = "jax"

    def __init__(self, model: nnx.Module, *, tokenizer=None, mesh: Mesh | None = None,
                 rules: LogicalRules = SAMPLE_RULES, buckets: Buckets = Buckets(),
                 weight_version: int = 0, seed: int = 0, adapter: bool = True,
                 copy_weights: bool = True, score_chunk: int = 256, weight_layout: str = "auto",
                 shared=nnx.filterlib.Nothing(), record_routes: bool = False,
                 capacity_factor: float | None = None,
                 platform_policy: PlatformPolicy | None = None,
                 settings: JaxSection = JaxSection()):
        moe = any(isinstance(n, SparseMoE) for _, n in nnx.iter_graph(model))
        if record_routes and not moe:
            raise ValueError("JaxEngine(record_routes=True) records MoE routing, but the model "
                             "has no MoE layer; leave it off (config.train.router_replay=False)")
        self.record_routes, self.capacity_factor = record_routes, capacity_factor
        self.recurrent = model.config.linear_attention is not None  # gated DeltaNet layers
        self.mesh, self.settings = mesh, settings
        if mesh is not None and mesh.shape.get("context", 1) > 1 and self._continuous():
            rules = context_as_rows(rules)  # each sequence's pages on one device
        self.tokenizer, self.mesh, self.rules, self.buckets = tokenizer, mesh, rules, buckets
        self.shared = shared  # nnx filter: variables held as the caller's arrays, never copied
        # the platform's choices (rlx.platform.policy): by default those of the mesh's devices
        self.platform_policy = platform_policy or (policy_of(mesh) if mesh is not None
                                                   else current())
        self.weight_layout = resolve_layout(weight_layout, self.platform_policy)
        self.adapter, self.copy_weights, self.score_chunk = adapter, copy_weights, score_chunk
        self.weight_version = int(weight_version)
        self._paged = None
        self._seed, self._calls = seed, 0
        self._fns: dict = {}
        self._stop_tables: dict[tuple[str, ...], StopTable | None] = {}
        self._prefix, self._prefilled = PrefixCache(), 0
        self._dropped = 0 if moe and capacity_factor else None  # (token, expert) pairs
        self._graphdef, self._state = None, None
        self.update_weights(model, weight_version)

    # --- weights --------------------------------------------------------------------------
    def update_weights(self, weights: nnx.Module | nnx.State, version: int) -> None:
        """Install a new model, or new values for some of its variables, as policy ``version``;
        the prefix cache's rows (the old version's) are dropped."""
        self._prefix.clear()
        if self._paged is not None:
            self._paged.clear()
        if isinstance(weights, nnx.Module):
            graphdef, state, self._transposed, self._shared, self._stacks = _eval_split(
                weights, self.weight_layout, self.shared, self.mesh, self.rules,
                self.capacity_factor, self.platform_policy)
            self._config = weights.config
            targets = self._targets(state)
            self._state = self._place(state, targets, fresh=self._transposed)
            if graphdef != self._graphdef:
                self._fns.clear()
                self._graphdef, self._state_shardings = graphdef, targets
                self._paged = self._paged_serving(weights.precision.dtype)
        else:
            self._check_open()
            known = {p for p, _ in nnx.to_flat_state(self._state)}
            unknown = [p for p, _ in nnx.to_flat_state(weights) if p not in known]
            if unknown:
                raise ValueError(f"update_weights: the engine's model has no variable at "
                                 f"{['/'.join(map(str, p)) for p in unknown[:5]]}")
            weights = transpose_update(weights, self._transposed)
            placed = self._place(weights, self._targets(weights), fresh=self._transposed)
            self._state = nnx.merge_state(self._state, placed)
        self.weight_version = int(version)

    def _held(self, path: tuple, variable: nnx.Variable) -> bool:
        """Whether a ``shared`` variable is held as it is: a device array already."""
        return tuple(path) in self._shared and isinstance(variable.get_value(), jax.Array)

    def _as_placed(self, path: tuple, variable: nnx.Variable) -> bool:
        """Whether the engine reads ``variable`` on its own sharding: a held shared array, or,
        when the engine copies no weights, any array already placed on the engine's mesh (the
        learner's adapters, split by the training rules)."""
        sharding = getattr(variable.get_value(), "sharding", None)
        return self._held(path, variable) or (
            not self.copy_weights and isinstance(sharding, NamedSharding)
            and sharding.mesh == self.mesh)

    def _targets(self, state: nnx.State) -> nnx.State | None:
        """The engine's sharding of each variable (None without a mesh): the sampling rules'
        (``self.rules``), an array read as placed (``_as_placed``) its own."""
        if self.mesh is None:
            return None
        rule = nnx.to_flat_state(variable_shardings(state, self.mesh, self.rules))
        return nnx.from_flat_state([
            (p, v.get_value().sharding if self._as_placed(p, v) else s)
            for (p, v), (_, s) in zip(nnx.to_flat_state(state), rule)])

    def _place(self, state: nnx.State, targets: nnx.State | None, fresh=frozenset()) -> nnx.State:
        """The engine's own copy of ``state`` on ``targets`` (no mesh: the default device).

        Held shared arrays (``_held``) and leaves at ``fresh`` paths (kernels just transposed into
        new buffers, the engine's already) are not copied."""
        flat = nnx.to_flat_state(state)
        own = [not self.copy_weights or tuple(p) in fresh or self._held(p, v) for p, v in flat]
        if targets is not None:
            alias = nnx.from_flat_state([(p, v.replace(a)) for (p, v), a in zip(flat, own)])
            return jax.device_put(state, targets, may_alias=alias)
        copy = lambda v: jax.tree.map(lambda x: jnp.array(x, copy=True), v)  # noqa: E731
        return nnx.from_flat_state([(p, v if a else copy(v)) for (p, v), a in zip(flat, own)])

    # --- compiled functions ---------------------------------------------------------------
    def _data_parallel(self) -> int:
        return 1 if self.mesh is None else batch_shards(self.mesh, self.rules)

    def _jit(self, fn, n_rows_args: tuple[int, ...], n_scalars: int, out_ndims: tuple[int, ...],
             more_in: tuple = (), more_out: tuple = ()):
        """``jax.jit`` with the state on its shardings, row arrays over the batch axes (then
        ``more_in``; outputs ``more_out`` after the row arrays); compiled once per shape ahead of
        its first run, the compiler's freed heap returned first."""
        if self.mesh is None:
            return CompiledPerShape(jax.jit(fn))
        rows = [batch_sharding(self.mesh, nd, self.rules) for nd in n_rows_args]
        scalars = [NamedSharding(self.mesh, PartitionSpec())] * n_scalars
        outs = tuple(batch_sharding(self.mesh, nd, self.rules) for nd in out_ndims) + more_out
        return CompiledPerShape(jax.jit(
            fn, in_shardings=(self._state_shardings, *rows, *scalars, *more_in),
            out_shardings=outs if len(outs) > 1 else outs[0]))

    def _buffer_shardings(self) -> tuple[tuple, tuple] | None:
        """Shardings of a cache's keys and values (one per layer, or per stack of a scanned
        model; ``cache_sharding``); None without a mesh."""
        if self.mesh is None:
            return None
        keys, values = cache_sharding(self.mesh, self._config, self.rules, self._data_parallel())
        if self._stacks is not None:
            keys, values = stacked((keys, values))
        n = self._config.num_layers if self._stacks is None else len(self._stacks)
        return (keys,) * n, (values,) * n

    def _generate_fn(self, spec: SamplerSpec, new_tokens: int, keep: bool = False,
                     continued: bool = False):
        """The generate program; ``keep``: it also returns its cache's keys and values;
        ``continued``: it takes a ``KeptPrefix`` after the scalars."""
        kv = rows = None
        if self.mesh is not None:
            kv = cache_sharding(self.mesh, self._config, self.rules, self._data_parallel())
            rows = batch_sharding(self.mesh, 2, self.rules)
        static = GenerateStatic(self._graphdef, spec, new_tokens, self.adapter, kv, rows,
                                self.record_routes, keep_cache=keep,
                                count_dropped=self._dropped is not None)
        if (static, continued) not in self._fns:
            fn = functools.partial(generate_batch, static=static)
            # ids [u, p], lens [u]; prompt of row, uid hash, sample index [b];
            # seed, sampler knobs, max_new, stops (, kept prefix); out: tokens, logps,
            # lengths, stopped (and the prompt and completion routes, [b, p | n, l, k])
            # (and the pairs a capacity dropped) (and the cache's keys and values)
            outs = (2, 2, 1, 1) + ((4, 4) if self.record_routes else ())
            buffers = self._buffer_shardings()
            more_in = more_out = ()
            if buffers is not None:
                more_in = (KeptPrefix(*buffers, batch_sharding(self.mesh, 1, self.rules)),
                           ) if continued else ()
                more_out = ((NamedSharding(self.mesh, PartitionSpec()),)
                            if self._dropped is not None else ()) + (buffers if keep else ())
            self._fns[static, continued] = self._jit(fn, (2, 1, 1, 1, 1), 4, outs, more_in,
                                                     more_out)
        return self._fns[static, continued]

    def _gather_fn(self, merge: bool):
        """``gather_prefix`` compiled per shape (``merge``: onto a previous gather's rows)."""
        key = ("gather", self._graphdef, merge)
        if key not in self._fns:
            kv = None if self.mesh is None else cache_sharding(
                self.mesh, self._config, self.rules, self._data_parallel())
            self._fns[key] = CompiledPerShape(jax.jit(functools.partial(
                gather_prefix, layers_stacked=self._stacks is not None, kv_sharding=kv)))
        return self._fns[key]

    def _score_fn(self):
        key = ("score", self._graphdef, self.adapter, self.score_chunk)
        if key not in self._fns:
            fn = functools.partial(sequence_logprobs, graphdef=self._graphdef, adapter=self.adapter,
                                   chunk=self.score_chunk)
            self._fns[key] = self._jit(fn, (2, 1), 0, (2,))
        return self._fns[key]

    def _rows(self, *arrays: np.ndarray) -> tuple:
        """Row arrays placed over the mesh's batch axes (in a multi-process job ``jit`` takes no
        numpy input with a sharding other than replicated, even on this process's own devices)."""
        if self.mesh is None:
            return arrays
        return tuple(jax.device_put(a, batch_sharding(self.mesh, a.ndim, self.rules)) for a in arrays)

    def compilations(self) -> int:
        """Programs compiled so far (one per bucket and sampling mode, and the prefix cache's
        continued buckets and gathers)."""
        return sum(f.compilations() for f in self._fns.values()) + (
            0 if self._paged is None else self._paged.compilations())

    # --- generation -----------------------------------------------------------------------
    def _paged_serving(self, dtype) -> PagedServing | None:
        """The continuous-batching path (``rlx.rollout.jax.paged``) where ``_continuous``."""
        if not self._continuous():
            return None
        mesh = self.mesh if self.mesh is not None and self.mesh.size > 1 else None
        one = jax.devices()[0] if self.mesh is None else self.mesh.devices.flat[0]
        return PagedServing(self._config, self._graphdef, self._stacks, dtype, self.settings,
                            self.settings.slots or self.platform_policy.decode_slots,
                            None if mesh else one, self.adapter, mesh, self.rules,
                            self._state_shardings, self.record_routes,
                            self.platform_policy.slot_buckets_per_octave)

    def _continuous(self) -> bool:
        """``batching`` "continuous", not on a mesh across processes (whose rows the host
        scheduler cannot feed and read all: lockstep there, for now)."""
        across = self.mesh is not None and any(d.process_index != jax.process_index()
                                               for d in self.mesh.devices.flat)
        return self.settings.batching == "continuous" and not (across or self.recurrent)

    def batching_stats(self) -> Stats | None:
        """Decode steps, slot occupancy and preemptions of the last continuous ``generate``
        (None when the engine runs lockstep)."""
        return None if self._paged is None else self._paged.stats

    def generate(self, prompts: Sequence[Prompt], sampling: SamplingParams) -> list[Rollout]:
        """``sampling.n`` completions per prompt, prompt-major, tagged with ``weight_version``."""
        self._check_open()
        if sampling.stop_strings and self.tokenizer is None:
            raise ValueError("stop_strings need a tokenizer: pass JaxEngine(..., tokenizer=...)")
        for p in prompts:
            if not len(p.token_ids):
                raise ValueError(f"prompt {p.uid!r} has no tokens")
        seed = sampling.seed if sampling.seed is not None else self._seed + self._calls
        self._calls += 1
        if self._paged is not None:
            dropped = self._paged.dropped
            out = self._paged.run(self._state, prompts, sampling, seed, self._stops(sampling),
                                  self.tokenizer, self.weight_version)
            if self._dropped is not None:
                self._dropped += self._paged.dropped - dropped
            return out
        rows = [(i, j) for i in range(len(prompts)) for j in range(sampling.n)]
        order = sorted(rows, key=lambda r: -len(prompts[r[0]].token_ids))
        out: dict[tuple[int, int], Rollout] = {}
        kept = self._prefix.take()  # the last call's rows: this call reads them, then frees them
        step = self.buckets.max_rows
        for start in range(0, len(order), step):
            chunk = order[start:start + step]
            out.update(zip(chunk, self._run_batch([(prompts[i], j) for i, j in chunk], sampling,
                                                  seed, kept)))
        return [out[r] for r in rows]

    def _run_batch(self, reqs: list[tuple[Prompt, int]], sampling: SamplingParams,
                   seed: int, kept: PrefixCache) -> list[Rollout]:
        b = self.buckets
        rows = b.rows(len(reqs), self._data_parallel())
        prompts, prompt_rows, of_row = shared_prompts(
            reqs, rows, lambda n: b.rows(n, self._data_parallel()))
        prefix, ids, lens, slots = self._prompt_block(prompts, prompt_rows, kept)
        self._prefilled += int(lens.sum())
        hashes = np.zeros((rows,), np.uint32)
        hashes[:len(reqs)] = [uid_hash(p.uid) for p, _ in reqs]
        index = np.zeros((rows,), np.int32)
        index[:len(reqs)] = [j for _, j in reqs]
        spec, stops = SamplerSpec.of(sampling), self._stops(sampling)
        keep = self._prefix.depth > 0 and not (self.record_routes or self.recurrent)
        fn = self._generate_fn(spec, b.new_tokens(sampling.max_new_tokens), keep, prefix is not None)
        scalars = (np.int32(seed), Knobs.of_sampling(sampling), np.int32(sampling.max_new_tokens))
        outs = fn(self._state, *self._rows(ids, lens, of_row, hashes, index), *scalars, stops,
                  *(() if prefix is None else (prefix,)))
        buffers = tuple(outs[-2:]) if keep else None  # stays on the device
        tokens, logps, lengths, stopped, *routes = host_values(outs[:-2] if keep else outs)
        if self._dropped is not None:
            self._dropped += int(routes.pop())
        rollouts = [row_rollout(p, j, tokens[r], logps[r], int(lengths[r]), bool(stopped[r]),
                                sampling, self.tokenizer, self.weight_version, [x[r] for x in routes])
                    for r, (p, j) in enumerate(reqs)]
        if keep:
            width = ids.shape[1] + (0 if prefix is None else prefix.width)
            self._prefix.keep(rollouts, buffers, [slots[i] for i in of_row[:len(reqs)]], width,
                              self.weight_version)
        return rollouts

    # --- prefix cache ---------------------------------------------------------------------
    @contextlib.contextmanager
    def prefix_cache(self):
        """Within it, a request that extends a sequence the previous ``generate`` call produced
        continues from that sequence's KV-cache row and prefills only its new tokens; leaving
        it frees the kept rows (``rlx.rollout.jax.prefix_cache``; nested, the outermost). Routing
        replay (``record_routes``) keeps no rows: every request is prefilled whole."""
        self._prefix.depth += 1
        if self._paged is not None:
            self._paged.keep = True
        try:
            yield self
        finally:
            self._prefix.depth -= 1
            if not self._prefix.depth:
                self._prefix.clear()
                if self._paged is not None:
                    self._paged.keep = False
                    self._paged.clear()

    def prefilled_tokens(self) -> int:
        """Prompt tokens fed through prefills so far (a prompt shared by ``n`` samples once; a
        continued request only its new tokens)."""
        return self._prefilled + (0 if self._paged is None else self._paged.prefilled)

    def counters(self) -> dict[str, int]:
        """Counts so far that a run logs per batch (``rollout/<name>``): "moe_dropped_pairs"
        (``dropped_pairs``, where pairs can be dropped), "preempted" (continuous batching)."""
        return ({} if self._dropped is None else {"moe_dropped_pairs": self._dropped}) | (
            {} if self._paged is None else {"preempted": self._paged.preempted})

    def dropped_pairs(self) -> int | None:
        """(token, expert) pairs that the MoE dispatch capacity (``capacity_factor``) dropped in
        this engine's prefills and decode steps so far, padding rows included; None when nothing
        can be dropped (a dense model, or dropless)."""
        return self._dropped

    def _stops(self, sampling: SamplingParams):
        return device_stops(sampling.stop_token_ids, self._stop_table(sampling.stop_strings))

    def _stop_table(self, strings: tuple[str, ...]) -> StopTable | None:
        """The device automaton of ``strings`` (``rlx.rollout.jax.stops``), built once per set;
        None without strings or for a tokenizer without its tokens' bytes (the host cuts)."""
        if strings not in self._stop_tables:
            self._stop_tables[strings] = stop_table(self.tokenizer, strings,
                                                    self._config.vocab_size)
        return self._stop_tables[strings]

    def cached_sequences(self) -> int:
        """Sequences whose KV-cache rows the prefix cache holds now (continuous batching:
        pages the prefix index holds)."""
        return len(self._prefix) + (0 if self._paged is None else self._paged.cached_sequences())

    def _prompt_block(self, prompts: Sequence[Prompt], prompt_rows: int, kept: PrefixCache):
        """What the prompt rows prefill: the tokens after the kept sequence each prompt extends
        (all of them where none), left padded, and their lengths; the ``KeptPrefix`` they
        continue (None when no prompt continues one); each prompt's slots (``prompt_slots``)."""
        starts = [kept.find(p.token_ids, self.weight_version) if len(kept) else None
                  for p in prompts]
        done = [0 if s is None else s.length for s in starts]
        tails = [p.token_ids[k:] for p, k in zip(prompts, done)]
        longest = max(map(len, tails))
        width = self.buckets.extend(longest) if any(done) else self.buckets.prompt(longest)
        ids, lens = pack_left(tails, prompt_rows, width)
        if not any(done):
            return None, ids, lens, [prompt_slots(width, len(t)) for t in tails]
        before = self.buckets.prompt(max(done))
        return (self._gather(starts, prompt_rows, before), ids, lens,
                [prompt_slots(width, len(t), k, before) for t, k in zip(tails, done)])

    def _gather(self, starts: Sequence[CachedRow | None], rows: int, width: int) -> KeptPrefix:
        """The kept rows that prompt rows continue (None: nothing kept), each left padded in
        ``width`` slots: one ``gather_prefix`` per batch they come from."""
        lens, sources = gather_plan(starts, rows, width)
        out = None
        for buffers, src, slots, take in sources:
            out = self._gather_fn(out is not None)(*buffers, *self._rows(src, slots, take),
                                                   *(() if out is None else (out,)))
        return KeptPrefix(*out, *self._rows(lens))

    # --- scoring and lifecycle ------------------------------------------------------------
    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[np.ndarray]:
        """Teacher-forced raw-policy log-probs of the tokens after each prompt (``[len - p]``)."""
        self._check_open()
        for s, p in sequences:
            if not 1 <= p <= len(s):
                raise ValueError(f"score: prompt length {p} outside [1, {len(s)}]")
        out: list[np.ndarray] = []
        step = self.buckets.max_rows
        for start in range(0, len(sequences), step):
            chunk = sequences[start:start + step]
            width = self.buckets.prompt(max(len(s) for s, _ in chunk))
            ids, lens = pack_left([list(s) for s, _ in chunk],
                                   self.buckets.rows(len(chunk), self._data_parallel()), width)
            logp = host_values(self._score_fn()(self._state, *self._rows(ids, lens)))
            out += [logp[r, width - len(s) + p - 1: width - 1] for r, (s, p) in enumerate(chunk)]
        return out

    def close(self) -> None:
        self._state, self._fns, self._paged = None, {}, None
        self._prefix.clear()

    def _check_open(self) -> None:
        if self._state is None:
            raise RolloutError("JaxEngine is closed")
