// clops AdamW step, in place: torch.optim.AdamW's update with bias correction and
// decoupled weight decay, for one flat parameter tensor.
//
// Layout: p, m, v (float32 master state) and g (of storage type GST: float,
// half or bf16, widened on load), flat arrays of n elements; with PST, p_half
// gets the updated p rounded once to nearest even in storage type PST (half or
// bf16). Per element, in torch's order of operations:
//   p ·= decay                                (decay = 1 − lr·weight_decay)
//   m += (1 − β1)·(g − m)                     (torch's lerp)
//   v  = β2·v + (1 − β2)·g²
//   p −= step_size · m / (sqrt(v)/bc2_sqrt + eps)
// with step_size = lr/(1 − β1^step) and bc2_sqrt = sqrt(1 − β2^step) from the host.
// Work-item g of group b handles EPT vectors of VW elements at
// (b·WG·EPT + g)·VW + k·WG·VW, k < EPT (each step of a group one contiguous
// run), every array accessed as whole vectors aligned to their size (vload of
// floats only assumes 4-byte alignment: NVIDIA's compiler splits it into
// scalar accesses); a vector that would cross n is done element by element.
//
// Parameters: WG work-items per group, VW vector width, EPT vectors per work
// item, IDX the index type (uint when every index fits 32 bits, else ulong), GST
// g's storage type, PST p_half's (None: no p_half).
<%namespace name="common" file="common.cl.mako"/>\
#define WG ${wg}
#define VW ${vw}
#define EPT ${ept}
typedef ${idx} idx_t;
${common.guards()}\
${common.storage(gst, pst)}\
<% half_arg = ", __global %s *restrict p_half" % ctype(pst) if pst else "" %>\

<%def name="update(T)">
            ${T} pi = p_ * decay;
            m_ += one_minus_beta1 * (g_ - m_);
            v_ = beta2 * v_ + one_minus_beta2 * (g_ * g_);
            pi -= step_size * (m_ / (sqrt(v_) / bc2_sqrt + eps));
</%def>

__kernel __attribute__((reqd_work_group_size(WG, 1, 1)))
void adamw(__global float *restrict p, __global float *restrict m, __global float *restrict v,
           __global const ${ctype(gst)} *restrict g${half_arg}, const idx_t n, const float decay, const float one_minus_beta1,
           const float beta2, const float one_minus_beta2, const float step_size, const float bc2_sqrt,
           const float eps${checked_args("p", "m", "v", "g", *(["p_half"] if pst else []))})
{
    const idx_t first = ((idx_t)get_group_id(0) * (WG * EPT) + (idx_t)get_local_id(0)) * VW;
    for (int k = 0; k < EPT; ++k) {
        const idx_t i = first + (idx_t)k * (WG * VW);
        if (i + VW <= n) {
            ${vtype(vw)} p_ = ${load("float", vw, "p", at("p", "i", vw), aligned=True)};
            ${vtype(vw)} m_ = ${load("float", vw, "m", at("m", "i", vw), aligned=True)};
            ${vtype(vw)} v_ = ${load("float", vw, "v", at("v", "i", vw), aligned=True)};
            ${vtype(vw)} g_ = ${load(gst, vw, "g", at("g", "i", vw), aligned=True)};
            ${update(vtype(vw))}
            ${store("float", vw, "pi", "p", at("p", "i", vw), aligned=True)};
            ${store("float", vw, "m_", "m", at("m", "i", vw), aligned=True)};
            ${store("float", vw, "v_", "v", at("v", "i", vw), aligned=True)};
% if pst:
            ${store(pst, vw, "pi", "p_half", at("p_half", "i", vw), aligned=True)};
% endif
        } else {
            for (idx_t j = i; j < n; ++j) {
                float p_ = p[${at("p", "j")}], m_ = m[${at("m", "j")}], v_ = v[${at("v", "j")}], g_ = ${load(gst, 1, "g", at("g", "j"))};
                ${update("float")}
                p[${at("p", "j")}] = pi;
                m[${at("m", "j")}] = m_;
                v[${at("v", "j")}] = v_;
% if pst:
                ${store(pst, 1, "pi", "p_half", at("p_half", "j"))};
% endif
            }
        }
    }
}
