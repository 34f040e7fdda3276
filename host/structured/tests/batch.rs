//! Constrained and unconstrained requests in one engine batch (toy executor): the constrained
//! ones follow their grammar, the others produce exactly what they produce alone, in the
//! synchronous and the overlapped pipeline alike.

use k3_engine::testing::{ToyConfig, ToyExecutor};
use k3_engine::{EngineConfig, EngineCore, Request, RequestSampler, SamplingParams};
use k3_model::Executor;
use k3_structured::{
    ConstrainedSampler, GrammarCompiler, GrammarPlan, OutputConstraint, TokenBytes, token_env,
};

const WIDTH: usize = 128;
const EOS: u32 = 0;

/// EOS, then printable ASCII one byte per token; the rest unused.
fn vocab() -> Vec<TokenBytes> {
    let mut v = vec![TokenBytes::Special("<|end_of_msg|>".into())];
    v.extend((0x20u8..0x7f).map(|b| TokenBytes::Text(vec![b])));
    v.resize(WIDTH, TokenBytes::Unused);
    v
}

fn text(tokens: &[u32]) -> String {
    tokens
        .iter()
        .filter(|&&t| t != EOS)
        .map(|&t| char::from(0x1f + t as u8))
        .collect()
}

#[derive(Clone)]
struct Job {
    prompt: Vec<u32>,
    params: SamplingParams,
    constraint: Option<OutputConstraint>,
}

fn unconstrained(prompt: Vec<u32>, temperature: f32) -> Job {
    Job {
        prompt,
        params: SamplingParams {
            temperature,
            seed: Some(7),
            max_tokens: Some(12),
            ignore_eos: true,
            ..SamplingParams::default()
        },
        constraint: None,
    }
}

fn constrained(prompt: Vec<u32>, temperature: f32, c: OutputConstraint) -> Job {
    Job {
        prompt,
        params: SamplingParams {
            temperature,
            seed: Some(3),
            max_tokens: Some(40),
            ..SamplingParams::default()
        },
        constraint: Some(c),
    }
}

/// Run all jobs together; each one's generated tokens.
fn run(jobs: &[Job], overlap: bool) -> Vec<Vec<u32>> {
    let compiler = GrammarCompiler::new(token_env(&vocab(), &[EOS]).unwrap()).unwrap();
    let mut exec = ToyExecutor::new(ToyConfig {
        vocab: WIDTH,
        arena_bytes: 1 << 16,
        ..ToyConfig::default()
    })
    .unwrap();
    let cfg = EngineConfig {
        prefix_cache: false,
        eos_token_ids: vec![EOS],
        overlap,
        max_context: 512,
        ..EngineConfig::default()
    };
    let mut core = EngineCore::new(exec.layout(), exec.vocab_size(), cfg).unwrap();
    let mut rxs = Vec::new();
    for (id, j) in jobs.iter().enumerate() {
        let mut req = Request::new(id as u64, j.prompt.clone(), j.params.clone());
        if let Some(c) = &j.constraint {
            let inner = RequestSampler::new(&j.params, WIDTH, &j.prompt).unwrap();
            let plan = GrammarPlan {
                grammar: compiler.compile_constraint(c).unwrap(),
                trigger: None,
            };
            req.sampler = Some(Box::new(
                ConstrainedSampler::new(Box::new(inner), plan).unwrap(),
            ));
        }
        rxs.push(core.submit(req).unwrap());
    }
    let mut inflight = None;
    while if overlap {
        core.step_overlapped(&mut exec, &mut inflight)
    } else {
        core.step(&mut exec)
    } {}
    rxs.into_iter()
        .map(|mut rx| {
            let mut out = Vec::new();
            while let Ok(ev) = rx.try_recv() {
                out.push(ev.expect("request failed").token);
            }
            out
        })
        .collect()
}

#[test]
fn constrained_requests_leave_their_batch_mates_unchanged() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y"]}},
        "required": ["a", "b"],
        "additionalProperties": false
    });
    let free = [
        unconstrained(vec![5, 6, 7], 0.0),
        unconstrained(vec![9, 9, 9, 9, 9], 0.9),
        unconstrained(vec![40, 2], 0.0),
    ];
    let bound = [
        constrained(
            vec![5, 6, 7],
            0.0,
            OutputConstraint::JsonSchema {
                schema,
                strict: true,
            },
        ),
        constrained(vec![11], 0.8, OutputConstraint::Regex("[a-f]{2,5}!".into())),
        constrained(
            vec![12, 13],
            0.0,
            OutputConstraint::Choice(vec!["alpha".into(), "beta".into()]),
        ),
    ];
    for overlap in [false, true] {
        let alone = run(&free, overlap);
        let mixed: Vec<Job> = free.iter().cloned().chain(bound.iter().cloned()).collect();
        let together = run(&mixed, overlap);
        assert_eq!(
            &together[..3],
            &alone[..],
            "overlap {overlap}: unconstrained outputs changed"
        );
        assert!(alone.iter().all(|o| o.len() == 12));
        let outputs: Vec<String> = together[3..].iter().map(|t| text(t)).collect();
        for (o, t) in outputs.iter().zip(&together[3..]) {
            assert_eq!(t.last(), Some(&EOS), "{o}: the grammar completed, so EOS");
        }
        let json: serde_json::Value = serde_json::from_str(&outputs[0]).unwrap();
        assert!(
            json["a"].is_i64() && ["x", "y"].contains(&json["b"].as_str().unwrap()),
            "{json}"
        );
        let rx = &outputs[1];
        assert!(
            rx.ends_with('!') && rx[..rx.len() - 1].chars().all(|c| ('a'..='f').contains(&c)),
            "{rx}"
        );
        assert!(
            ["alpha", "beta"].contains(&outputs[2].as_str()),
            "{}",
            outputs[2]
        );
    }
}
