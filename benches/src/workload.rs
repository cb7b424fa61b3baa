//! Gradient lists of real models, as (name, element count, dtype).

use gradclip::DType;

/// One gradient tensor of a workload.
#[derive(Clone, Debug)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Elements.
    pub len: u64,
    /// Element type.
    pub dtype: DType,
}

/// A named list of gradients.
#[derive(Clone, Debug)]
pub struct Workload {
    /// Preset name.
    pub name: String,
    /// The tensors.
    pub tensors: Vec<TensorSpec>,
}

impl Workload {
    /// Total elements.
    pub fn elements(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len * t.dtype.size()).sum()
    }
    /// The same tensor list with every length divided by `factor` (at least 1 element each).
    pub fn scaled_down(&self, factor: u64) -> Workload {
        let tensors = self.tensors.iter().map(|t| TensorSpec { len: (t.len / factor).max(1), ..t.clone() }).collect();
        Workload { name: format!("{} (1/{factor} scale)", self.name), tensors }
    }
}

fn push(v: &mut Vec<TensorSpec>, name: String, len: u64, dtype: DType) {
    v.push(TensorSpec { name, len, dtype });
}

/// `seed-500`: 500 bf16 gradients of a dense decoder (Llama-3-8B widths with Qwen2-style q/k/v
/// biases, 41 layers, untied embeddings and a multi-token-prediction head): 10.0 billion
/// elements, 20.0 GB.
pub fn seed_500() -> Workload {
    let (d, kv, f, vocab, layers) = (4096u64, 1024u64, 14336u64, 128_256u64, 41);
    let bf = DType::Bf16;
    let mut v = Vec::new();
    push(&mut v, "embed_tokens".into(), vocab * d, bf);
    for l in 0..layers {
        let p = |n: &str| format!("layers.{l}.{n}");
        push(&mut v, p("input_layernorm"), d, bf);
        push(&mut v, p("q_proj.weight"), d * d, bf);
        push(&mut v, p("q_proj.bias"), d, bf);
        push(&mut v, p("k_proj.weight"), kv * d, bf);
        push(&mut v, p("k_proj.bias"), kv, bf);
        push(&mut v, p("v_proj.weight"), kv * d, bf);
        push(&mut v, p("v_proj.bias"), kv, bf);
        push(&mut v, p("o_proj.weight"), d * d, bf);
        push(&mut v, p("post_attention_layernorm"), d, bf);
        push(&mut v, p("gate_proj"), f * d, bf);
        push(&mut v, p("up_proj"), f * d, bf);
        push(&mut v, p("down_proj"), d * f, bf);
    }
    push(&mut v, "norm".into(), d, bf);
    push(&mut v, "lm_head".into(), vocab * d, bf);
    push(&mut v, "mtp.enorm".into(), d, bf);
    push(&mut v, "mtp.hnorm".into(), d, bf);
    push(&mut v, "mtp.eh_proj".into(), d * 2 * d, bf);
    push(&mut v, "mtp.norm".into(), d, bf);
    push(&mut v, "mtp.input_layernorm".into(), d, bf);
    Workload { name: "seed-500".into(), tensors: v }
}

#[cfg(test)]
mod tests {
    #[test]
    fn seed_500_has_500_tensors_of_about_ten_billion_elements() {
        let w = super::seed_500();
        assert_eq!(w.tensors.len(), 500);
        assert!((9.9e9..10.3e9).contains(&(w.elements() as f64)), "{}", w.elements());
    }
}
