//! `--speculative-config`: vLLM's JSON shape (or a `[speculative-config]` table in the TOML
//! file), the draft source it names, and the step-cost profile the verify planner reads
//! (docs/speculative-decoding.md): measured on the executor at start-up, or loaded from the file
//! an earlier start wrote.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, bail};
use k3_engine::SpeculationConfig;
use k3_model::{Executor, ForwardBatch, LogitsWant, SeqInput};
use k3_speculative::{DraftSourceFactory, NgramParams, StepCostProfile};
use serde::{Deserialize, Serialize};

/// The settings, as the operator writes them.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpeculativeSettings {
    /// `ngram` (prompt lookup) or `dspark` (the drafter model in `model`).
    pub method: String,
    /// Most draft tokens one verify checks.
    pub num_speculative_tokens: usize,
    /// The drafter's directory (`dspark`).
    #[serde(default)]
    pub model: Option<PathBuf>,
    /// Prompt lookup: shortest and longest suffix matched [defaults: 2 and 4].
    #[serde(default)]
    pub prompt_lookup_min: Option<usize>,
    #[serde(default)]
    pub prompt_lookup_max: Option<usize>,
    /// Step-cost profile file: loaded when it exists, else measured and written there.
    #[serde(default)]
    pub cost_profile: Option<PathBuf>,
    /// vLLM's sampling-method keys, accepted for compatibility: drafts of a sampled request are
    /// always drawn from the drafter's distribution, and verification is always the standard
    /// lossless rule.
    #[serde(default)]
    pub draft_sample_method: Option<String>,
    #[serde(default)]
    pub rejection_sample_method: Option<String>,
}

impl SpeculativeSettings {
    /// From the flag's JSON text.
    pub fn from_json(text: &str) -> anyhow::Result<Self> {
        let s: Self = serde_json::from_str(text).context("--speculative-config is not valid")?;
        s.validated()
    }

    /// From the TOML file's `speculative-config`: a table, or the same JSON as a string.
    pub fn from_toml(value: toml::Value) -> anyhow::Result<Self> {
        match value {
            toml::Value::String(text) => Self::from_json(&text),
            other => {
                let s: Self = other
                    .try_into()
                    .context("speculative-config in the config file is not valid")?;
                s.validated()
            }
        }
    }

    fn validated(self) -> anyhow::Result<Self> {
        if self.num_speculative_tokens == 0 {
            bail!("speculative-config: num_speculative_tokens must be at least 1");
        }
        match self.method.as_str() {
            "ngram" => {
                let (min, max) = self.lookup_range();
                if min == 0 || min > max {
                    bail!(
                        "speculative-config: prompt_lookup_min {min} and prompt_lookup_max {max} \
                         must satisfy 1 <= min <= max"
                    );
                }
            }
            "dspark" => {
                if self.model.is_none() {
                    bail!(
                        "speculative-config: method dspark needs \"model\": the drafter's directory"
                    );
                }
            }
            other => {
                bail!("speculative-config: method {other:?} is not supported; use ngram or dspark")
            }
        }
        if let Some(m) = self.draft_sample_method.as_deref()
            && m != "probabilistic"
        {
            bail!(
                "speculative-config: draft_sample_method {m:?} is not supported (probabilistic is)"
            );
        }
        Ok(self)
    }

    fn lookup_range(&self) -> (usize, usize) {
        let max = self.prompt_lookup_max.unwrap_or(4);
        (self.prompt_lookup_min.unwrap_or(2.min(max)), max)
    }

    /// The draft source factory the settings name.
    pub fn source(&self, target_dir: &Path) -> anyhow::Result<Arc<dyn DraftSourceFactory>> {
        match self.method.as_str() {
            "ngram" => {
                let (min_n, max_n) = self.lookup_range();
                Ok(Arc::new(NgramParams {
                    min_n,
                    max_n,
                    ..NgramParams::default()
                }))
            }
            "dspark" => {
                let dir = self.model.as_deref().context("dspark needs a model")?;
                super::dspark_source::load(dir, target_dir)
            }
            other => bail!("speculative-config: unknown method {other:?}"),
        }
    }
}

/// The profile as stored on disk.
#[derive(Debug, Serialize, Deserialize)]
struct ProfileFile {
    /// `[tokens, seconds]` of one target step.
    points: Vec<(usize, f64)>,
}

/// The engine's speculation settings: the source, and the cost profile loaded from
/// `settings.cost_profile` or measured on `exec` (and then written there). Returns a line for
/// the progress log too.
pub fn build(
    settings: &SpeculativeSettings,
    target_dir: &Path,
    exec: &mut dyn Executor,
    max_num_seqs: usize,
) -> anyhow::Result<(SpeculationConfig, String)> {
    let source = settings.source(target_dir)?;
    let k = settings.num_speculative_tokens;
    let lay = exec.layout();
    if k + 1 > lay.verify_tokens_max {
        bail!(if lay.verify_tokens_max == 0 {
            "speculative decoding is not available on this device's backend yet".to_string()
        } else {
            format!(
                "num_speculative_tokens {k} is more than this model verifies at once ({})",
                lay.verify_tokens_max - 1
            )
        });
    }
    let stored = settings
        .cost_profile
        .as_deref()
        .filter(|p| p.exists())
        .map(load_profile)
        .transpose()?;
    let (cost, origin) = match stored {
        Some(c) => (c, "loaded"),
        None => {
            let c = measure(exec, k, max_num_seqs)?;
            if let Some(path) = &settings.cost_profile {
                let text = serde_json::to_string_pretty(&ProfileFile {
                    points: c.points().to_vec(),
                })?;
                std::fs::write(path, text)
                    .with_context(|| format!("writing the cost profile {}", path.display()))?;
            }
            (c, "measured")
        }
    };
    let pts = cost.points();
    let summary = format!(
        "speculative decoding on: {} drafts up to {k} tokens; step cost {origin}: {} tokens {:.2} ms … {} tokens {:.2} ms",
        source.method(),
        pts[0].0,
        pts[0].1 * 1e3,
        pts[pts.len() - 1].0,
        pts[pts.len() - 1].1 * 1e3,
    );
    Ok((
        SpeculationConfig {
            source,
            max_draft: k,
            cost: Some(cost),
        },
        summary,
    ))
}

fn load_profile(path: &Path) -> anyhow::Result<StepCostProfile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the cost profile {}", path.display()))?;
    let file: ProfileFile = serde_json::from_str(&text)
        .with_context(|| format!("the cost profile {} is not valid", path.display()))?;
    StepCostProfile::new(file.points)
        .with_context(|| format!("the cost profile {} has no usable point", path.display()))
}

/// Context each measured sequence attends to: a verify never runs on an empty sequence.
const PROFILE_CONTEXT: usize = 32;

/// Seconds of one target step by token count, timed on the idle executor before the engine
/// starts (the median of 3 runs per point, after one untimed run): up to the batch size, one-token decodes of that many
/// sequences; beyond it, the batch's sequences each verifying a share of the tokens (at most
/// `k + 1`), as steps with drafts run.
fn measure(
    exec: &mut dyn Executor,
    k: usize,
    max_num_seqs: usize,
) -> anyhow::Result<StepCostProfile> {
    let lay = exec.layout();
    let pages_per_seq = (PROFILE_CONTEXT + k + 1).div_ceil(lay.page_tokens);
    let seq_bytes = 2 * lay.state_block_bytes + pages_per_seq * lay.kv_page_bytes;
    let max_seqs = (lay.arena_bytes / seq_bytes.max(1))
        .min(max_num_seqs)
        .max(1);
    let layout: Vec<(usize, usize, Vec<usize>)> = (0..max_seqs)
        .map(|i| {
            let base = i * seq_bytes;
            let pages = (0..pages_per_seq)
                .map(|p| base + 2 * lay.state_block_bytes + p * lay.kv_page_bytes)
                .collect();
            (base, base + lay.state_block_bytes, pages)
        })
        .collect();
    let context: Vec<u32> = (0..PROFILE_CONTEXT as u32).map(|t| 10 + t).collect();
    for (state, _, pages) in &layout {
        exec.arena_zero(*state, lay.state_block_bytes)?;
        run(exec, &[(*state, None, pages, &context[..], 0)])?;
    }
    let mut points = Vec::new();
    for b in (0..16).map(|i| 1usize << i) {
        let seqs = b.min(max_seqs);
        let each = b.div_ceil(seqs);
        if each > k + 1 {
            break;
        }
        let step: Vec<u32> = (0..each as u32).map(|t| 100 + t).collect();
        let batch: Vec<_> = layout[..seqs]
            .iter()
            .map(|(state, record, pages)| {
                let record = (each > 1).then_some(*record);
                (*state, record, pages, &step[..], PROFILE_CONTEXT)
            })
            .collect();
        // One untimed pass first: a device backend compiles kernels, loads libraries and records
        // its graphs on a shape's first step, which no later step pays.
        run(exec, &batch)?;
        let mut times = Vec::new();
        for _ in 0..3 {
            let t = Instant::now();
            run(exec, &batch)?;
            times.push(t.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        points.push((seqs * each, times[1]));
    }
    StepCostProfile::new(points).context("measuring the step cost gave no usable point")
}

type ProfileSeq<'a> = (usize, Option<usize>, &'a Vec<usize>, &'a [u32], usize);

fn run(exec: &mut dyn Executor, seqs: &[ProfileSeq<'_>]) -> anyhow::Result<()> {
    let batch = ForwardBatch {
        seqs: seqs
            .iter()
            .map(|&(state, record, pages, tokens, start)| SeqInput {
                tokens,
                start_pos: start,
                kv_pages: pages,
                state_block: state,
                checkpoints: &[],
                logits: if record.is_some() {
                    LogitsWant::All
                } else {
                    LogitsWant::Last
                },
            })
            .collect(),
        verify_records: seqs.iter().map(|s| s.1).collect(),
        ..Default::default()
    };
    exec.forward(&batch)
        .context("a step of the cost measurement")?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_shapes_and_refuses_bad_ones() {
        let s = SpeculativeSettings::from_json(
            r#"{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}"#,
        )
        .unwrap();
        assert_eq!((s.num_speculative_tokens, s.lookup_range()), (5, (2, 3)));
        let d = SpeculativeSettings::from_json(
            r#"{"method": "dspark", "model": "models/k3-mini-dspark", "num_speculative_tokens": 7,
                "draft_sample_method": "probabilistic", "rejection_sample_method": "block"}"#,
        )
        .unwrap();
        assert_eq!(d.model.as_deref(), Some(Path::new("models/k3-mini-dspark")));
        let table: toml::Value = toml::from_str(
            "method = \"ngram\"\nnum_speculative_tokens = 4\ncost_profile = \"/tmp/x.json\"\n",
        )
        .unwrap();
        assert_eq!(
            SpeculativeSettings::from_toml(table)
                .unwrap()
                .num_speculative_tokens,
            4
        );
        for bad in [
            r#"{"method": "eagle", "num_speculative_tokens": 3}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 0}"#,
            r#"{"method": "dspark", "num_speculative_tokens": 3}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 2}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3, "typo": 1}"#,
            r#"{"method": "ngram", "num_speculative_tokens": 3, "draft_sample_method": "greedy"}"#,
            "not json",
        ] {
            assert!(SpeculativeSettings::from_json(bad).is_err(), "{bad}");
        }
    }
}
