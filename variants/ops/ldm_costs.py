"""Forward FLOPs per token of LDM and LDM-RLS, counted for the implementation that runs (``mixer.impl``).

The two forms cost differently. The recurrent form materializes ``M`` (and ``P``), so a read is ``2·d·d_k`` and an
RLS write adds ``O(G·d_k²)``, whatever the depth. The dual form, the default, never builds them: a read is a sum
over the writes so far, ``2·(G·d_k + d)`` per write, and an RLS write first projects out the earlier whitened
writes. With ``groups=1`` (``d_k = d``) the recurrent count is ``2·d²`` per read against ``O(L·d)`` for what runs,
so pricing the wrong form overstates the cost many times.

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
    mm = other = 0

    def mlp(out: int) -> None:
        # Matmuls 2·d·h + 2·h·o; biases h + o, SiLU ≈ 4h, the RMS norm with its gain ≈ 4d.
        nonlocal mm, other
        mm += 2 * d * h + 2 * h * out
        other += 5 * h + out + 4 * d

    def unit() -> None:
        # G vectors of width d_k: norm, clamp, division.
        nonlocal other
        other += 3 * G * dk + G

    def read(n: int) -> None:
        """A read over ``n`` writes."""
        nonlocal mm, other
        mlp(G * dk)
        unit()
        if dual:
            # k_iᵀ q and Σ_i v_i (k_iᵀ q): two batched products over the stacked writes.
            mm += n * 2 * G * dk + n * 2 * d
        else:
            mm += 2 * d * dk  # M q
        other += d if mixer.cfg.read != "memory" else 0  # x + M q

    def write(n: int) -> None:
        """The write after ``n`` earlier writes."""
        nonlocal mm, other
        mlp(key_out)
        unit()
        if not mixer.rls:
            other += 0 if dual else (2 * d * dk if n else d * dk)  # M + v kᵀ
            return
        other += 6 * G  # λ, ω and the ridge entry d_n = Πλ / (α ω)
        if dual:
            # Gram–Schmidt against the earlier whitened writes: l = K k (a batched product), then k, v and δ²
            # less their projections, |k|², the floor and the division by δ.
            mm += n * 2 * G * dk
            other += n * (2 * G * dk + 2 * d + 2 * G) + 3 * G + G * dk + d
            return
        # κ = P k̄ / (λ + k̄ᵀ P k̄), u = v̄ − M k̄, M += u κᵀ, P = (P − (P k̄)(P k̄)ᵀ / s) / λ.
        mm += 2 * G * dk * dk + (2 * d * dk if n else 0)
        other += G * (dk + dv) + 3 * G * dk + G + d + (2 * d * dk if n else d * dk) + 4 * G * dk * dk

    n = 0
    if mixer.embed_write:
        write(n)
        n += 1
    for reader in range(mixer.n_layers + 1):
        if n:
            read(n)
        if reader < mixer.n_layers:
            write(n)
            n += 1
    return mm, other
