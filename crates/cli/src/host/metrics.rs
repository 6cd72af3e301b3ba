//! The models' own metrics in the host's `/metrics`: each model's deployment writes vLLM's
//! families labelled with its `model_name`, and tpctl's own without it; the host joins them so
//! every family appears once (its `# HELP` and `# TYPE` first, then the samples of every
//! model), as the Prometheus text format requires, and labels a sample that names no model
//! with `model`, so two models' samples never read as one series.

/// One metric family: its header lines and its samples, in the order met.
struct Family {
    name: String,
    headers: Vec<String>,
    samples: Vec<String>,
}

/// Joins the `/metrics` texts of several deployments (each with its model's name) into one
/// text with each family once.
pub fn merge(texts: &[(String, String)]) -> String {
    let mut families: Vec<Family> = Vec::new();
    let find = |families: &mut Vec<Family>, name: &str| -> usize {
        match families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                families.push(Family {
                    name: name.to_owned(),
                    headers: Vec::new(),
                    samples: Vec::new(),
                });
                families.len() - 1
            }
        }
    };
    for (model, text) in texts {
        // The family a header last opened: its histogram's `_bucket`, `_sum` and `_count`
        // samples follow under it.
        let mut current: Option<usize> = None;
        for line in text.lines() {
            let line = line.trim_end();
            if let Some(rest) =
                line.strip_prefix("# HELP ").or_else(|| line.strip_prefix("# TYPE "))
            {
                let name = rest.split_whitespace().next().unwrap_or_default();
                let i = find(&mut families, name);
                if !families[i].headers.iter().any(|h| h == line) {
                    families[i].headers.push(line.to_owned());
                }
                current = Some(i);
                continue;
            }
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let sample = line.split(['{', ' ']).next().unwrap_or_default();
            let i = match current {
                Some(i) if sample.starts_with(families[i].name.as_str()) => i,
                _ => find(&mut families, sample),
            };
            families[i].samples.push(labelled(line, model));
        }
    }
    let mut out = String::new();
    for family in families {
        for line in family.headers.iter().chain(&family.samples) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// A sample line with the label `model="MODEL"` unless it names its model already.
fn labelled(line: &str, model: &str) -> String {
    if line.contains("model_name=\"") {
        return line.to_owned();
    }
    let label = format!("model=\"{}\"", model.replace('\\', "\\\\").replace('"', "\\\""));
    match line.find(['{', ' ']) {
        Some(at) if line[at..].starts_with("{}") => {
            format!("{}{{{label}}}{}", &line[..at], &line[at + 2..])
        }
        Some(at) if line[at..].starts_with('{') => {
            format!("{}{{{label},{}", &line[..at], &line[at + 1..])
        }
        Some(at) => format!("{}{{{label}}}{}", &line[..at], &line[at..]),
        None => line.to_owned(),
    }
}

#[cfg(test)]
mod tests;
