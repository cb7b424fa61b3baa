//! Gradient lists of real models, as (name, element count, dtype), and user shape files.

use std::path::Path;

use gradclip::DType;
use serde::{Deserialize, Serialize};

/// One gradient tensor of a workload.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Parameter name.
    pub name: String,
    /// Shape (its product is the element count).
    pub shape: Vec<u64>,
    /// Element type: "bf16", "f16", "f32" or "f64".
    pub dtype: String,
}

impl TensorSpec {
    /// Elements.
    pub fn len(&self) -> u64 {
        self.shape.iter().product()
    }
    /// Element type.
    pub fn dtype(&self) -> DType {
        parse_dtype(&self.dtype).expect("validated when loaded")
    }
    /// Bytes.
    pub fn bytes(&self) -> u64 {
        self.len() * self.dtype().size()
    }
}

fn parse_dtype(s: &str) -> Option<DType> {
    match s {
        "bf16" | "bfloat16" => Some(DType::Bf16),
        "f16" | "fp16" | "float16" | "half" => Some(DType::F16),
        "f32" | "fp32" | "float32" | "float" => Some(DType::F32),
        "f64" | "fp64" | "float64" | "double" => Some(DType::F64),
        _ => None,
    }
}

/// A named list of gradients.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Workload {
    /// Preset or file name.
    pub name: String,
    /// The tensors.
    pub tensors: Vec<TensorSpec>,
}

impl Workload {
    /// Total elements.
    pub fn elements(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::len).sum()
    }
    /// Total bytes.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(TensorSpec::bytes).sum()
    }
    /// The same list with the first dimension of every tensor divided by `factor` (at least 1).
    pub fn scaled_down(&self, factor: u64) -> Workload {
        let tensors = self
            .tensors
            .iter()
            .map(|t| {
                let mut shape = t.shape.clone();
                if let Some(d0) = shape.first_mut() {
                    *d0 = (*d0 / factor).max(1);
                }
                TensorSpec { shape, ..t.clone() }
            })
            .collect();
        Workload {
            name: format!("{} (1/{factor} scale)", self.name),
            tensors,
        }
    }

    /// Reads a JSON file: `{"name": ..., "tensors": [{"name", "shape", "dtype"}, ...]}` or just
    /// the list of tensors.
    pub fn from_file(path: &Path) -> Result<Workload, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        let w: Workload = serde_json::from_str(&text)
            .or_else(|_| {
                serde_json::from_str::<Vec<TensorSpec>>(&text).map(|tensors| Workload {
                    name: path.display().to_string(),
                    tensors,
                })
            })
            .map_err(|e| {
                format!(
                    "{}: expected {{\"name\", \"tensors\": [{{\"name\", \"shape\", \"dtype\"}}]}}: {e}",
                    path.display()
                )
            })?;
        for t in &w.tensors {
            if parse_dtype(&t.dtype).is_none() {
                return Err(format!(
                    "{}: tensor {} has dtype {:?}; use bf16, f16, f32 or f64",
                    path.display(),
                    t.name,
                    t.dtype
                ));
            }
        }
        Ok(w)
    }
}

/// Names of the built-in presets.
pub const PRESETS: [&str; 6] = [
    "seed-500",
    "llama3-70b-fsdp8",
    "qwen3-30b-a3b-ep8",
    "lora-70b-r16",
    "gpt2-124m",
    "mixed",
];

/// The preset called `name`.
pub fn preset(name: &str) -> Option<Workload> {
    Some(match name {
        "seed-500" => seed_500(),
        "llama3-70b-fsdp8" => llama3_70b_fsdp8(),
        "qwen3-30b-a3b-ep8" => qwen3_30b_a3b_ep8(),
        "lora-70b-r16" => lora_70b_r16(),
        "gpt2-124m" => gpt2_124m(),
        "mixed" => mixed(),
        _ => return None,
    })
}

struct Builder(Vec<TensorSpec>);

impl Builder {
    fn add(&mut self, name: impl Into<String>, shape: &[u64], dtype: &str) {
        self.0.push(TensorSpec {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: dtype.into(),
        });
    }
    fn done(self, name: &str) -> Workload {
        Workload {
            name: name.into(),
            tensors: self.0,
        }
    }
}

/// A Llama-style decoder layer's weights: (name, shape) with `d` hidden, `kv` key/value width,
/// `f` MLP width.
fn llama_layer(d: u64, kv: u64, f: u64) -> Vec<(&'static str, Vec<u64>)> {
    vec![
        ("input_layernorm.weight", vec![d]),
        ("self_attn.q_proj.weight", vec![d, d]),
        ("self_attn.k_proj.weight", vec![kv, d]),
        ("self_attn.v_proj.weight", vec![kv, d]),
        ("self_attn.o_proj.weight", vec![d, d]),
        ("post_attention_layernorm.weight", vec![d]),
        ("mlp.gate_proj.weight", vec![f, d]),
        ("mlp.up_proj.weight", vec![f, d]),
        ("mlp.down_proj.weight", vec![d, f]),
    ]
}

/// `seed-500`: 500 bf16 gradients of a dense decoder (Llama-3-8B widths with Qwen2-style q/k/v
/// biases, 41 layers, untied embeddings and a multi-token-prediction head): 10.03 G elements.
pub fn seed_500() -> Workload {
    let (d, kv, f, vocab) = (4096u64, 1024u64, 14336u64, 128_256u64);
    let mut b = Builder(Vec::new());
    b.add("model.embed_tokens.weight", &[vocab, d], "bf16");
    for l in 0..41 {
        for (n, s) in llama_layer(d, kv, f) {
            b.add(format!("model.layers.{l}.{n}"), &s, "bf16");
        }
        for (n, w) in [("q", d), ("k", kv), ("v", kv)] {
            b.add(format!("model.layers.{l}.self_attn.{n}_proj.bias"), &[w], "bf16");
        }
    }
    b.add("model.norm.weight", &[d], "bf16");
    b.add("lm_head.weight", &[vocab, d], "bf16");
    for n in ["enorm", "hnorm", "norm", "input_layernorm"] {
        b.add(format!("mtp.{n}.weight"), &[d], "bf16");
    }
    b.add("mtp.eh_proj.weight", &[d, 2 * d], "bf16");
    b.done("seed-500")
}

/// `llama3-70b-fsdp8`: one rank's FSDP shard of Llama-3-70B (dim 0 split 8 ways), fp32.
pub fn llama3_70b_fsdp8() -> Workload {
    let (d, kv, f, vocab, ranks) = (8192u64, 1024u64, 28672u64, 128_256u64, 8u64);
    let shard = |s: &[u64]| {
        let mut s = s.to_vec();
        s[0] /= ranks;
        s
    };
    let mut b = Builder(Vec::new());
    b.add("model.embed_tokens.weight", &shard(&[vocab, d]), "f32");
    for l in 0..80 {
        for (n, s) in llama_layer(d, kv, f) {
            b.add(format!("model.layers.{l}.{n}"), &shard(&s), "f32");
        }
    }
    b.add("model.norm.weight", &shard(&[d]), "f32");
    b.add("lm_head.weight", &shard(&[vocab, d]), "f32");
    b.done("llama3-70b-fsdp8")
}

/// `qwen3-30b-a3b-ep8`: one expert-parallel rank of Qwen3-30B-A3B: attention, router and norms of
/// all 48 layers plus 16 of the 128 experts per layer, bf16.
pub fn qwen3_30b_a3b_ep8() -> Workload {
    let (d, q, kv, hd, moe_f, experts, vocab) = (2048u64, 4096u64, 512u64, 128u64, 768u64, 128u64, 151_936u64);
    let mut b = Builder(Vec::new());
    b.add("model.embed_tokens.weight", &[vocab, d], "bf16");
    for l in 0..48 {
        let p = |n: &str| format!("model.layers.{l}.{n}");
        b.add(p("input_layernorm.weight"), &[d], "bf16");
        b.add(p("self_attn.q_proj.weight"), &[q, d], "bf16");
        b.add(p("self_attn.k_proj.weight"), &[kv, d], "bf16");
        b.add(p("self_attn.v_proj.weight"), &[kv, d], "bf16");
        b.add(p("self_attn.o_proj.weight"), &[d, q], "bf16");
        b.add(p("self_attn.q_norm.weight"), &[hd], "bf16");
        b.add(p("self_attn.k_norm.weight"), &[hd], "bf16");
        b.add(p("post_attention_layernorm.weight"), &[d], "bf16");
        b.add(p("mlp.gate.weight"), &[experts, d], "bf16");
        for e in 0..experts / 8 {
            b.add(p(&format!("mlp.experts.{e}.gate_proj.weight")), &[moe_f, d], "bf16");
            b.add(p(&format!("mlp.experts.{e}.up_proj.weight")), &[moe_f, d], "bf16");
            b.add(p(&format!("mlp.experts.{e}.down_proj.weight")), &[d, moe_f], "bf16");
        }
    }
    b.add("model.norm.weight", &[d], "bf16");
    b.add("lm_head.weight", &[vocab, d], "bf16");
    b.done("qwen3-30b-a3b-ep8")
}

/// `lora-70b-r16`: rank-16 LoRA adapters (A and B) on every linear layer of Llama-3-70B, fp32.
pub fn lora_70b_r16() -> Workload {
    let (d, kv, f, r) = (8192u64, 1024u64, 28672u64, 16u64);
    let mut b = Builder(Vec::new());
    for l in 0..80 {
        for (n, s) in llama_layer(d, kv, f) {
            if s.len() == 2 {
                let name = n.trim_end_matches(".weight");
                b.add(format!("model.layers.{l}.{name}.lora_A.weight"), &[r, s[1]], "f32");
                b.add(format!("model.layers.{l}.{name}.lora_B.weight"), &[s[0], r], "f32");
            }
        }
    }
    b.done("lora-70b-r16")
}

/// `gpt2-124m`: GPT-2 small, fp32.
pub fn gpt2_124m() -> Workload {
    let (d, vocab, ctx) = (768u64, 50_257u64, 1024u64);
    let mut b = Builder(Vec::new());
    b.add("wte.weight", &[vocab, d], "f32");
    b.add("wpe.weight", &[ctx, d], "f32");
    for l in 0..12 {
        let p = |n: &str| format!("h.{l}.{n}");
        b.add(p("ln_1.weight"), &[d], "f32");
        b.add(p("ln_1.bias"), &[d], "f32");
        b.add(p("attn.c_attn.weight"), &[d, 3 * d], "f32");
        b.add(p("attn.c_attn.bias"), &[3 * d], "f32");
        b.add(p("attn.c_proj.weight"), &[d, d], "f32");
        b.add(p("attn.c_proj.bias"), &[d], "f32");
        b.add(p("ln_2.weight"), &[d], "f32");
        b.add(p("ln_2.bias"), &[d], "f32");
        b.add(p("mlp.c_fc.weight"), &[d, 4 * d], "f32");
        b.add(p("mlp.c_fc.bias"), &[4 * d], "f32");
        b.add(p("mlp.c_proj.weight"), &[4 * d, d], "f32");
        b.add(p("mlp.c_proj.bias"), &[d], "f32");
    }
    b.add("ln_f.weight", &[d], "f32");
    b.add("ln_f.bias", &[d], "f32");
    b.done("gpt2-124m")
}

/// `mixed`: Llama-3-8B with bf16 gradients for the linear layers and fp32 gradients for the
/// embeddings and norms (a common mixed-precision layout), one list.
pub fn mixed() -> Workload {
    let (d, kv, f, vocab) = (4096u64, 1024u64, 14336u64, 128_256u64);
    let mut b = Builder(Vec::new());
    b.add("model.embed_tokens.weight", &[vocab, d], "f32");
    for l in 0..32 {
        for (n, s) in llama_layer(d, kv, f) {
            b.add(format!("model.layers.{l}.{n}"), &s, if s.len() == 1 { "f32" } else { "bf16" });
        }
    }
    b.add("model.norm.weight", &[d], "f32");
    b.add("lm_head.weight", &[vocab, d], "bf16");
    b.done("mixed")
}

/// 1,000 f32 tensors of 1,024 elements: the launch- and host-bound case.
pub fn small_1000() -> Workload {
    let mut b = Builder(Vec::new());
    for i in 0..1000 {
        b.add(format!("t{i}"), &[1024], "f32");
    }
    b.done("small-1000x1024-f32")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn presets_have_their_documented_sizes() {
        let w = seed_500();
        assert_eq!(w.tensors.len(), 500);
        assert!((9.9e9..10.3e9).contains(&(w.elements() as f64)), "{}", w.elements());
        let l = llama3_70b_fsdp8();
        assert!((8.6e9..9.0e9).contains(&(l.elements() as f64)), "{}", l.elements());
        assert_eq!(l.tensors.len(), 723);
        let q = qwen3_30b_a3b_ep8();
        assert!(q.tensors.len() > 2000, "{}", q.tensors.len());
        let lo = lora_70b_r16();
        assert!((0.5e9..1.0e9).contains(&(lo.bytes() as f64)), "{}", lo.bytes());
        let g = gpt2_124m();
        assert!((124e6..125e6).contains(&(g.elements() as f64)), "{}", g.elements());
        let m = mixed();
        assert!(m.tensors.iter().any(|t| t.dtype == "f32") && m.tensors.iter().any(|t| t.dtype == "bf16"));
        for p in PRESETS {
            assert!(preset(p).is_some());
        }
    }

    #[test]
    fn shape_files_round_trip_and_reject_unknown_dtypes() {
        // Removed when the test ends, pass or fail.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w.json");
        std::fs::write(&p, serde_json::to_string(&gpt2_124m()).unwrap()).unwrap();
        assert_eq!(Workload::from_file(&p).unwrap().elements(), gpt2_124m().elements());
        std::fs::write(&p, r#"[{"name": "a", "shape": [3, 4], "dtype": "int8"}]"#).unwrap();
        assert!(Workload::from_file(&p).unwrap_err().contains("int8"));
        std::fs::write(&p, r#"[{"name": "a", "shape": [3, 4], "dtype": "bf16"}]"#).unwrap();
        assert_eq!(Workload::from_file(&p).unwrap().bytes(), 24);
    }
}
