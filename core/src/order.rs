//! The order a converge's built images build in: each after the images it builds `FROM`.
//!
//! The manifest orders its images with it (and refuses a cycle as a manifest error), and the
//! coordinator checks a request's `ImageSpec.from` graph with it, so both read a graph the same way.

/// A topological order of `deps` — `deps[i]` are the nodes node `i` waits for — with the lowest
/// index first among those ready, so file order holds wherever the graph allows; or, when the graph
/// has a cycle, one cycle `c0 → c1 → … → c0` (its first node repeated at the end; a node waiting
/// for itself is `[i, i]`). An index out of range is a node that does not exist: it is ignored.
pub fn topological(deps: &[Vec<usize>]) -> Result<Vec<usize>, Vec<usize>> {
    let waits = |i: usize| deps[i].iter().copied().filter(|&d| d < deps.len());
    let mut placed = vec![false; deps.len()];
    let mut order = Vec::with_capacity(deps.len());
    // Quadratic in the worst case; a converge holds hundreds of images, not millions, and the
    // result keeps file order wherever the graph allows, which is what a reader expects.
    while order.len() < deps.len() {
        match (0..deps.len()).find(|&i| !placed[i] && waits(i).all(|d| placed[d])) {
            Some(i) => {
                placed[i] = true;
                order.push(i);
            }
            None => {
                // Every node not placed waits for another node not placed, so walking from the
                // first of them along unplaced dependencies must come back to a node walked: a cycle.
                let mut walked: Vec<usize> = Vec::new();
                let mut at = (0..deps.len()).find(|&i| !placed[i]).expect("a node waits");
                loop {
                    if let Some(start) = walked.iter().position(|&n| n == at) {
                        let mut cycle = walked.split_off(start);
                        cycle.push(at);
                        return Err(cycle);
                    }
                    walked.push(at);
                    at = waits(at).find(|&d| !placed[d]).expect("an unplaced node waits for an unplaced node");
                }
            }
        }
    }
    Ok(order)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_order_keeps_file_order_where_the_graph_allows() {
        // 0 builds FROM 2, 1 FROM nothing, 2 FROM 1.
        assert_eq!(topological(&[vec![2], vec![], vec![1]]), Ok(vec![1, 2, 0]));
        assert_eq!(topological(&[vec![], vec![], vec![]]), Ok(vec![0, 1, 2]));
        assert_eq!(topological(&[vec![1, 2], vec![2], vec![]]), Ok(vec![2, 1, 0]));
        assert_eq!(topological(&[vec![7], vec![]]), Ok(vec![0, 1]), "a node that does not exist is ignored");
        assert_eq!(topological(&[]), Ok(vec![]));
    }

    #[test]
    fn a_cycle_is_found_and_given_from_its_first_node_back_to_it() {
        assert_eq!(topological(&[vec![1], vec![0]]), Err(vec![0, 1, 0]));
        assert_eq!(topological(&[vec![0]]), Err(vec![0, 0]), "an image FROM itself");
        // 0 waits on the cycle 1 → 2 → 1 without being in it.
        assert_eq!(topological(&[vec![1], vec![2], vec![1], vec![]]), Err(vec![1, 2, 1]));
    }
}
