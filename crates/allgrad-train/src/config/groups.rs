//! The `param_groups` section: which parameters take weight decay (and LARS's adaptation),
//! with which learning-rate scale, and which are frozen; its checks, and the name patterns
//! the groups are written with. The rule each parameter gets is resolved from it, once the
//! model's parameters exist, by `crate::optim::groups`.
//!
//! ```yaml
//! param_groups:
//!   exclude_1d: true              # the default: 1-D parameters take no weight decay
//!   groups:
//!     - { params: ["text_model.*", "text_projection.weight"], frozen: true }   # a locked tower (LiT)
//!     - { params: ["logit_scale"], lr_scale: 10.0 }
//!     - { params: ["vision_model.embeddings.*"], weight_decay: 0.0 }
//! ```

use serde::{Deserialize, Serialize};

use super::optim::OptimConfig;

/// The `param_groups` section.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields, default)]
pub struct ParamGroupsConfig {
    /// Parameters of fewer than two dimensions (biases, normalisation gains and shifts, CLIP's
    /// logit scale, SigLIP's logit bias, class embeddings) take no weight decay and, under
    /// LARS, no adaptation, as OpenCLIP and solo-learn train them. `false`: every parameter
    /// takes the optimizer's weight decay (and LARS's adaptation), as before this key existed.
    pub exclude_1d: bool,
    /// Groups of parameters by name, each with its own learning-rate scale and weight decay,
    /// or frozen. A parameter is in at most one group; one in none takes the default rule.
    pub groups: Vec<GroupConfig>,
}

impl Default for ParamGroupsConfig {
    fn default() -> Self {
        ParamGroupsConfig { exclude_1d: true, groups: Vec::new() }
    }
}

/// One entry of `param_groups.groups`.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct GroupConfig {
    /// Name patterns ([`name_matches`]); a parameter whose name one of them matches is in the
    /// group.
    pub params: Vec<String>,
    /// The group's learning rate is the schedule's times this.
    #[serde(default = "one")]
    pub lr_scale: f64,
    /// The group's weight decay, for every parameter of it (1-D ones too). Absent: the
    /// default rule's (the optimizer's, none on 1-D parameters with `exclude_1d`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_decay: Option<f64>,
    /// LARS only: whether the trust ratio scales the group's updates. Absent: the default
    /// rule's (yes, except on excluded 1-D parameters).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lars_adaptation: Option<bool>,
    /// Frozen: the parameters keep their values; the forward reads them untracked (no backward
    /// runs into a frozen tower, no gradient of them is kept), the optimizer keeps no state for
    /// them. A locked tower.
    #[serde(default)]
    pub frozen: bool,
}

fn one() -> f64 {
    1.0
}

impl ParamGroupsConfig {
    /// Checks the values against each other and the optimizer; the message names the key
    /// (`param_groups.groups[i].lr_scale`). Whether each pattern matches a parameter, and no
    /// parameter two groups, is checked once the model exists (`crate::optim::groups`).
    pub fn validate(&self, optim: &OptimConfig) -> Result<(), String> {
        for (i, g) in self.groups.iter().enumerate() {
            let key = |k: &str| format!("param_groups.groups[{i}].{k}");
            if g.params.is_empty() {
                return Err(format!("{} is empty: give at least one parameter-name pattern", key("params")));
            }
            if let Some(p) = g.params.iter().find(|p| p.is_empty()) {
                return Err(format!("{} has an empty pattern {p:?}", key("params")));
            }
            if g.frozen {
                let set: Vec<&str> = [
                    (g.lr_scale != 1.0).then_some("lr_scale"),
                    g.weight_decay.map(|_| "weight_decay"),
                    g.lars_adaptation.map(|_| "lars_adaptation"),
                ]
                .into_iter()
                .flatten()
                .collect();
                if !set.is_empty() {
                    return Err(format!(
                        "param_groups.groups[{i}] is frozen, so its {} would do nothing: remove {}",
                        set.join(" and "),
                        if set.len() == 1 { "it" } else { "them" }
                    ));
                }
                continue;
            }
            if !(g.lr_scale.is_finite() && g.lr_scale > 0.0) {
                return Err(format!(
                    "{} must be a positive number, got {} (to keep a group's parameters fixed, set frozen: true)",
                    key("lr_scale"),
                    g.lr_scale
                ));
            }
            if let Some(wd) = g.weight_decay {
                if !(wd.is_finite() && wd >= 0.0) {
                    return Err(format!("{} must be at least 0, got {wd}", key("weight_decay")));
                }
            }
            if g.lars_adaptation.is_some() && !matches!(optim, OptimConfig::Lars { .. }) {
                return Err(format!("{} is a LARS key, but optim.kind is not lars: remove it", key("lars_adaptation")));
            }
        }
        Ok(())
    }
}

/// Whether `name` matches `pattern` as a whole: `*` stands for any run of characters (dots
/// included, none too), `?` for one character, every other character for itself
/// (`vision_model.*`, `*.bias`, `text_model.encoder.layers.?.*`, `logit_scale`).
///
/// Written here rather than taken from a glob crate: file-path globs treat `/` and `**`
/// specially, parameter names have neither, and the two-pointer match below is the whole
/// algorithm (linear backtracking over the last `*`).
pub fn name_matches(pattern: &str, name: &str) -> bool {
    let (p, n): (Vec<char>, Vec<char>) = (pattern.chars().collect(), name.chars().collect());
    let (mut i, mut j) = (0, 0);
    // The last `*` seen and the name position it is taken to end at.
    let mut star: Option<(usize, usize)> = None;
    while j < n.len() {
        if i < p.len() && (p[i] == '?' || (p[i] != '*' && p[i] == n[j])) {
            i += 1;
            j += 1;
        } else if i < p.len() && p[i] == '*' {
            star = Some((i, j));
            i += 1;
        } else if let Some((si, sj)) = star {
            // The `*` takes one more character.
            i = si + 1;
            j = sj + 1;
            star = Some((si, sj + 1));
        } else {
            return false;
        }
    }
    p[i..].iter().all(|c| *c == '*')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_whole_names_with_star_and_question_mark() {
        let yes = [
            ("logit_scale", "logit_scale"),
            ("*", "anything.at.all"),
            ("*", ""),
            ("vision_model.*", "vision_model.encoder.layers.0.mlp.fc1.weight"),
            ("*.bias", "text_model.final_layer_norm.bias"),
            ("*layer_norm*", "text_model.encoder.layers.1.layer_norm2.weight"),
            ("text_model.encoder.layers.?.*", "text_model.encoder.layers.3.self_attn.q_proj.weight"),
            ("a*b*c", "abbbc"),
            ("a*b*c", "axxbyyc"),
            ("**", "x"),
        ];
        for (p, n) in yes {
            assert!(name_matches(p, n), "{p:?} should match {n:?}");
        }
        let no = [
            ("logit_scale", "logit_scale2"),
            ("logit_scale", "a.logit_scale"),
            ("vision_model.*", "vision_modelx"),
            ("*.bias", "text_model.bias_free.weight"),
            ("text_model.encoder.layers.?.*", "text_model.encoder.layers.11.mlp.fc1.weight"),
            ("a*b*c", "abcx"),
            ("?", ""),
            ("", "a"),
        ];
        for (p, n) in no {
            assert!(!name_matches(p, n), "{p:?} should not match {n:?}");
        }
    }

    fn adamw() -> OptimConfig {
        OptimConfig::Adamw { lr: 1e-3, beta1: 0.9, beta2: 0.98, eps: 1e-6, weight_decay: 0.2 }
    }

    fn group(params: &[&str]) -> GroupConfig {
        GroupConfig {
            params: params.iter().map(|s| s.to_string()).collect(),
            lr_scale: 1.0,
            weight_decay: None,
            lars_adaptation: None,
            frozen: false,
        }
    }

    #[test]
    fn bad_group_values_are_refused_naming_the_key() {
        let check = |g: GroupConfig, optim: &OptimConfig| {
            ParamGroupsConfig { exclude_1d: true, groups: vec![group(&["x"]), g] }.validate(optim)
        };
        let e = check(group(&[]), &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].params is empty"), "{e}");
        let e = check(group(&[""]), &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].params has an empty pattern"), "{e}");
        let e = check(GroupConfig { lr_scale: 0.0, ..group(&["a"]) }, &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].lr_scale must be a positive number, got 0") && e.contains("frozen"), "{e}");
        let e = check(GroupConfig { weight_decay: Some(-0.1), ..group(&["a"]) }, &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].weight_decay must be at least 0, got -0.1"), "{e}");
        let e = check(GroupConfig { lars_adaptation: Some(false), ..group(&["a"]) }, &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1].lars_adaptation is a LARS key"), "{e}");
        let lars = OptimConfig::Lars { lr: 0.1, momentum: 0.9, weight_decay: 1e-6, trust_coefficient: 1e-3, exclude_1d: true };
        check(GroupConfig { lars_adaptation: Some(false), ..group(&["a"]) }, &lars).unwrap();
        let e =
            check(GroupConfig { frozen: true, lr_scale: 2.0, weight_decay: Some(0.0), ..group(&["a"]) }, &adamw()).unwrap_err();
        assert!(e.contains("param_groups.groups[1] is frozen, so its lr_scale and weight_decay would do nothing"), "{e}");
        check(GroupConfig { frozen: true, ..group(&["a"]) }, &adamw()).unwrap();
    }
}
