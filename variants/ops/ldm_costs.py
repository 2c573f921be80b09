"""Forward FLOPs per token of LDM and LDM-RLS, counted for the implementation that runs (``mixer.impl``).

The two forms cost differently. The recurrent form materializes ``M`` (and ``P``), so a read is ``2·d·d_k`` and an
RLS write adds ``O(G·d_k²)``, whatever the depth. The dual form, the default, never builds them: a read is a sum
over the writes so far, ``2·(G·d_k + d)`` per write, and an RLS write first projects out the earlier whitened
writes. With ``groups=1`` (``d_k = d``) the recurrent count is ``2·d²`` per read against ``O(L·d)`` for what runs,
so pricing the wrong form overstates the cost many times.

With chunked reads (``mixer.chunk``, outer-product write only) every ``C`` writes are folded into a carried
``M``, ``2·d·d_k·C`` per fold; a read after the first fold then costs ``2·d·d_k`` for ``M q`` plus the dual sum over
the writes since the latest fold.

Both counts walk the forward in the order the mixer runs it (the embedding write, then a read and a write per
layer, then the head's read) and return matrix products, which ``torch.utils.flop_counter`` sees and the tests hold
them to exactly, apart from elementwise work (norms, activations, biases, additions), which is an analytic estimate.
A multiply-add counts 2.
"""

from __future__ import annotations


def flops_per_token(mixer) -> tuple[int, int]:
    """``(matrix-product FLOPs, elementwise FLOPs)`` per token of ``mixer``'s depth mixing, forward only."""
    if not mixer.uses_memory:
        return 0, 0
    d, h, G, dv, dk = mixer.d_model, mixer.cfg.qk_hidden, mixer.G, mixer.dv, mixer.dk
    dual = mixer.impl == "dual"
    key_out = G * dk + (G if mixer.omega_on else 0)
    # The dual form computes a layer's query and key MLPs in one pass when they read the same x.
    fused = dual and mixer.cfg.qk_source == "residual"
    mm = other = 0

    def mlps(*outs: int) -> None:
        # Matmuls 2·d·h + 2·h·o each; biases h + o, SiLU ≈ 4h. The RMS statistic is a norm (2d) and one scaling
        # (d) shared by the pass in the dual form, a norm of its own (≈ 4d) per MLP in the recurrent one.
        nonlocal mm, other
        mm += sum(2 * d * h + 2 * h * o for o in outs)
        other += sum(5 * h + o for o in outs) + (3 * d if dual else 4 * d * len(outs))

    def unit() -> None:
        # G vectors of width d_k: norm, clamp, division.
        nonlocal other
        other += 3 * G * dk + G

    chunk = mixer.chunk if dual else 0

    def read(n: int, reader: int) -> bool:
        """Reader ``reader`` over ``n`` writes; True when its pass also computed the key of its layer's write."""
        nonlocal mm, other
        with_key = fused and reader < mixer.n_layers
        mlps(G * dk, key_out) if with_key else mlps(G * dk)
        unit()
        if dual:
            folded = n - n % chunk if chunk else 0
            if folded:
                mm += 2 * d * dk  # M q
            unfolded = n - folded
            mm += unfolded * 2 * G * dk  # k_iᵀ q
            other += (2 * unfolded - (0 if folded else 1)) * d  # Σ_i v_i (k_iᵀ q)
        else:
            mm += 2 * d * dk  # M q
        other += d if mixer.cfg.read != "memory" else 0  # x + M q
        return with_key

    def write(n: int, key_done: bool) -> None:
        """The write after ``n`` earlier writes."""
        nonlocal mm, other
        if not key_done:
            mlps(key_out)
        unit()
        if chunk and (n + 1) % chunk == 0:
            mm += 2 * d * dk * chunk  # the fold: M + Σ v kᵀ over the chunk
            mm += 2 * G * dk * dk * chunk if mixer.rls else 0  # and the keys' Gram S + Σ k kᵀ
        if not mixer.rls:
            other += 0 if dual else (2 * d * dk if n else d * dk)  # M + v kᵀ
            return
        other += 6 * G  # λ, ω and the ridge entry d_n = Πλ / (α ω)
        if dual:
            folded = n - n % chunk if chunk else 0
            if folded:  # the folded writes at once: S k, M k, kᵀ S k, and the three subtractions
                mm += 2 * G * dk * dk + 2 * d * dk + 2 * G * dk
                other += G * dk + d + G
            n -= folded
            # Gram–Schmidt against the other earlier whitened writes: l_j = k̃_jᵀ k, then k, v and δ² updated per j.
            mm += (n + 1) * 2 * G * dk
            other += n * (2 * G * dk + 2 * d + 2 * G) + 3 * G + G * dk + d
            return
        # κ = P k̄ / (λ + k̄ᵀ P k̄), u = v̄ − M k̄, M += u κᵀ, P = (P − (P k̄)(P k̄)ᵀ / s) / λ.
        mm += 2 * G * dk * dk + (2 * d * dk if n else 0)
        other += G * (dk + dv) + 3 * G * dk + G + d + (2 * d * dk if n else d * dk) + 4 * G * dk * dk

    n = 0
    if mixer.embed_write:
        write(n, False)
        n += 1
    for reader in range(mixer.n_layers + 1):
        key_done = read(n, reader) if n else False
        if reader < mixer.n_layers:
            write(n, key_done)
            n += 1
    return mm, other
